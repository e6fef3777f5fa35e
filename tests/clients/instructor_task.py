"""instructor against localllm serve (/v1/chat/completions through the openai package): a Pydantic object
extracted in TOOLS mode (a forced function call) and in JSON_SCHEMA mode (response_format). Prints one JSON object.

    python instructor_task.py SERVER_URL MODEL
"""

import json
import sys

import instructor
from openai import OpenAI
from pydantic import BaseModel

URL, MODEL = sys.argv[1], sys.argv[2]


class Person(BaseModel):
    name: str
    age: int


out = {}
for key, mode in (("tools", instructor.Mode.TOOLS), ("json_schema", instructor.Mode.JSON_SCHEMA)):
    client = instructor.from_openai(OpenAI(base_url=URL + "/v1", api_key="sk-local", timeout=1200, max_retries=0),
                                    mode=mode)
    person = client.chat.completions.create(
        model=MODEL, response_model=Person, max_retries=1, temperature=0,
        messages=[{"role": "user", "content": "Extract the person: John Smith is 30 years old."}])
    out[key] = person.model_dump()
print(json.dumps(out))
