"""pydantic-ai against localllm serve (its OpenAI chat model, /v1/chat/completions): an agent whose output is a
validated Pydantic object (pydantic-ai asks for it as a forced tool call). Prints one JSON object.

    python pydantic_ai_task.py SERVER_URL MODEL
"""

import json
import sys

from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

URL, MODEL = sys.argv[1], sys.argv[2]


class Place(BaseModel):
    city: str
    country: str


model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=URL + "/v1", api_key="sk-local"))
agent = Agent(model, output_type=Place, retries=2)
result = agent.run_sync("Paris is the capital of which country? Give the city and the country.",
                        model_settings={"temperature": 0.0, "timeout": 1200})
print(json.dumps({"output": result.output.model_dump()}))
