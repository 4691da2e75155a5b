"""The question and the tool the OpenAI API tests send: the weather in Paris, and get_weather, whose one argument
is a unit of an enum."""

ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather",
            "parameters": {
                "type": "object",
                "properties": {"unit": UNIT},
                "required": ["unit"],
                "additionalProperties": False,
            },
        },
    }
]
