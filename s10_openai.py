from openai import OpenAI
client = OpenAI(base_url="http://localhost:18931/v1", api_key="unused")
for chunk in client.chat.completions.create(model="my-kvffn", messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=32, temperature=0, stream=True):
    print(chunk.choices[0].delta.content or "", end="")
print()
