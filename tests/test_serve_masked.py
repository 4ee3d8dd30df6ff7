"""`fusion serve --mode masked`: the same API over two groups computing on masked data; greedy
answers equal transformers', and the `fusion` field says which mode protected the request."""

from __future__ import annotations

from test_serve import API_KEY, build_chat_model, start_server, stop_server

from fusion_compute import reference
from fusion_compute.tokenizer import load_tokenizer


def test_masked_server_answers_like_transformers(tmp_path):
    model = build_chat_model(tmp_path / "m")
    live = start_server(["--model", str(model), "--mode", "masked", "--workers", "1+1", "--threads", "1",
                         "--api-key", API_KEY, "--served-model-name", "tiny"], tmp_path / "serve.log")  # fmt: skip
    try:
        messages = [{"role": "user", "content": "hello there"}]
        r = live.client().chat.completions.create(model="tiny", messages=messages, max_tokens=8)
        tok = load_tokenizer(model)
        ids = tok.chat_ids(messages)
        want = reference.greedy(reference.load_reference(model), ids, 8, stop_ids=tok.eos_ids)
        want_text = tok.decode([t for t in want if t not in tok.eos_ids], skip_special=True)
        assert r.choices[0].message.content == want_text
        ext = r.model_extra["fusion"]
        assert ext["mode"] == "masked" and ext["groups"] == [1, 1] and ext["workers"] == 2
        assert r.usage.prompt_tokens == len(ids)
    finally:
        stop_server(live.proc)
