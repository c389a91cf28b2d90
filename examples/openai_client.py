"""The official OpenAI client against pdxfer's router: one request without streaming, one with.

Works against any pdxfer router (toy workers, or `vllm serve` behind `--engine vllm`):

    pdxfer demo --help                     # or start a cluster as in docs/serving.md, then
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1

Prints the completion's text and usage, pdxfer's own figures for the request (which prefill
and decode served it, bytes of KV moved, prompt tokens restored from the decode's cache), then
the streamed chat reply as it comes. Exit status 0 when both requests finished.
"""

import argparse
import sys

from openai import OpenAI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="unused", help="a key of PDXFER_API_KEYS, if set")
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args(argv)
    client = OpenAI(base_url=a.base_url, api_key=a.api_key)
    model = client.models.list().data[0].id  # the served model's name

    # not streamed: one response with the whole text
    r = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=a.max_tokens, temperature=0
    )
    print(f"completion: {r.choices[0].text!r} (finish: {r.choices[0].finish_reason})")
    print(f"usage: {r.usage.prompt_tokens} prompt + {r.usage.completion_tokens} completion tokens")
    extra = (r.model_extra or {}).get("pdxfer", {})  # pdxfer's extension field
    print(
        "pdxfer:",
        {k: extra[k] for k in ("prefill", "decode", "bytes", "restored_tokens") if k in extra},
    )

    # streamed: one delta per chunk, then the usage chunk
    print("chat (streamed): ", end="", flush=True)
    finish = None
    for chunk in client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=a.max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
            finish = chunk.choices[0].finish_reason or finish
        elif chunk.usage:
            print(f"\nstream usage: {chunk.usage.completion_tokens} tokens, finish: {finish}")
    return 0 if finish in ("stop", "length") else 1


if __name__ == "__main__":
    sys.exit(main())
