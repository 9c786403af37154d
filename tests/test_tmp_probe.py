from .test_embedded_model import FORECAST, RUN, oai, MODEL, claude, ANTHROPIC_TOOLS

async def test_probe(server):
    async with oai(server) as client:
        for q in ["Hello there!", "Tell me about Lisbon.", "What is the capital of France?", "Thanks, that is all.", "Good morning!"]:
            for choice in ["auto", "required"]:
                r = await client.responses.create(model=MODEL, input=q, tools=[FORECAST, RUN], tool_choice=choice, max_output_tokens=256)
                print("OAI", q, choice, [(i.type, getattr(i, "name", None), getattr(i, "arguments", None) or getattr(i, "content", None)) for i in r.output])
    async with claude(server) as client:
        for q in ["Hello there!", "What's the weather in Oslo?", "Tell me about Lisbon."]:
            for choice in [{"type": "any"}, {"type": "tool", "name": RUN["name"]}]:
                reply = await client.messages.create(model="claude-sonnet-4-5", max_tokens=256, thinking={"type": "enabled", "budget_tokens": 1024}, tools=ANTHROPIC_TOOLS, tool_choice=choice, messages=[{"role": "user", "content": q}])
                print("ANT", q, choice, [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in reply.content])
