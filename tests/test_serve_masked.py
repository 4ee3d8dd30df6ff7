"""`fusion serve --mode masked`: the same API over two groups computing on masked data; greedy
answers equal transformers', alone and batched (`--max-batch`), and the `fusion` field says which
mode protected the request."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from test_serve import API_KEY, build_chat_model, start_server, stop_server

from fusion_compute.model import reference
from fusion_compute.weights.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # every test here starts workers or loads SmolLM2 (the quick loop skips them)


@pytest.mark.parametrize("max_batch", [1, 4])  # one request at a time (queued), or decoded together
def test_masked_server_answers_like_transformers(tmp_path, max_batch):
    model = build_chat_model(tmp_path / "m")
    live = start_server(
        [
            "--model",
            str(model),
            "--mode",
            "masked",
            "--workers",
            "1+1",
            "--executor",
            "inproc",
            "--threads",
            "1",
            "--api-key",
            API_KEY,
            "--served-model-name",
            "tiny",
            "--max-batch",
            str(max_batch),
        ],
        tmp_path / "serve.log",
    )
    try:
        tok = load_tokenizer(model)
        ref = reference.load_reference(model)

        def want(messages: list[dict]) -> str:
            ids = reference.greedy(ref, tok.chat_ids(messages), 8, stop_ids=tok.eos_ids)
            # the answer drops a last character its tokens left incomplete (one U+FFFD in a plain decode),
            # as vLLM's detokenizer does: this random model's bytes often end mid-character
            return tok.decode([t for t in ids if t not in tok.eos_ids], skip_special=True).removesuffix("\ufffd")

        def ask(text: str):
            messages = [{"role": "user", "content": text}]
            return live.client().chat.completions.create(model="tiny", messages=messages, max_tokens=8)

        r = ask("hello there")
        assert r.choices[0].message.content == want([{"role": "user", "content": "hello there"}])
        ext = r.model_extra["fusion"]
        assert ext["mode"] == "masked" and ext["groups"] == [1, 1] and ext["workers"] == 2
        assert r.usage.prompt_tokens == len(tok.chat_ids([{"role": "user", "content": "hello there"}]))
        questions = ["what is this", "tell me a story", "one two three"]
        # (this tiny random model may answer them alike: that sessions keep apart in a masked batch is
        # tests/test_batching.py's check, on logits that differ)
        wants = [want([{"role": "user", "content": q}]) for q in questions]
        with ThreadPoolExecutor(3) as ex:  # three at once: queued, or decoded together; each as if alone
            answers = [a.choices[0].message.content for a in ex.map(ask, questions)]
        assert answers == wants
        if max_batch == 1:  # the control page's map: for a masked plan, what each group receives
            import requests

            base = live.url.removesuffix("/v1")
            pic = requests.get(f"{base}/admin/picture.svg", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
            assert pic.status_code == 200 and pic.headers["content-type"].startswith("image/svg+xml"), pic.text
            assert "<svg" in pic.text and "groups 1+1" in pic.text
            assert requests.get(f"{base}/admin/picture.svg", timeout=60).status_code == 401
    finally:
        stop_server(live.proc)
