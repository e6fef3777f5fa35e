"""LangChain against localllm serve, through ChatOpenAI (/v1/chat/completions) and ChatOllama (/api/chat): a tool
call made and executed, and a Pydantic schema filled (with_structured_output). Prints one JSON object.

    python langchain_task.py SERVER_URL MODEL
"""

import json
import sys

from langchain_core.tools import tool
from langchain_ollama import ChatOllama
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

URL, MODEL = sys.argv[1], sys.argv[2]


@tool
def add(a: int, b: int) -> int:
    """Add two integers and return the sum."""
    return a + b


class Place(BaseModel):
    city: str
    country: str


def task(llm, **bind) -> dict:
    message = llm.bind_tools([add], **bind).invoke("What is 2 plus 3? Call the add tool to compute it.")
    call = message.tool_calls[0]
    place = llm.with_structured_output(Place, method="json_schema").invoke(
        "Paris is the capital of which country? Give the city and the country.")
    return {"tool_call": {"name": call["name"], "args": call["args"]}, "tool_result": add.invoke(call["args"]),
            "structured": place.model_dump()}


print(json.dumps({
    "openai": task(ChatOpenAI(base_url=URL + "/v1", api_key="sk-local", model=MODEL, temperature=0, timeout=1200,
                              max_retries=0), tool_choice="add"),
    "ollama": task(ChatOllama(base_url=URL, model=MODEL, temperature=0, client_kwargs={"timeout": 1200})),
}))
