"""POST /v1/embeddings through roseserve serve: OpenAI's shapes in and out (a string,
strings, token ids; floats or base64), equal to Hugging Face's pooled hidden states,
usage counted, and bad input refused with OpenAI's error."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import torch

from processes import Serve


def test_embeddings_over_http(tiny_llama_dir, tmp_path):
    from transformers import AutoModel, AutoTokenizer

    serve = Serve(tiny_llama_dir, tmp_path / "serve.log", "--pooling", "mean")
    try:
        serve.wait_ready()
        url = f"{serve.url}/v1/embeddings"
        texts = ["hello there", "a longer sentence to embed, with more tokens in it"]
        r = httpx.post(url, json={"model": "tiny", "input": texts}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["index"] for d in body["data"]] == [0, 1] and body["model"] == "tiny"
        tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
        ids = [tok(t)["input_ids"] for t in texts]
        assert body["usage"] == {"prompt_tokens": sum(map(len, ids)),
                                 "total_tokens": sum(map(len, ids))}
        hf = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
        for d, prompt in zip(body["data"], ids):
            with torch.no_grad():
                ref = hf(torch.tensor([prompt])).last_hidden_state[0].mean(0)
            ref = torch.nn.functional.normalize(ref, dim=0)
            assert float(torch.tensor(d["embedding"]) @ ref) >= 0.9999
        # token ids and base64 (little-endian float32): the same vector
        r = httpx.post(url, json={"input": ids[0], "encoding_format": "base64"}, timeout=60)
        assert r.status_code == 200, r.text
        packed = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")
        assert np.allclose(packed, body["data"][0]["embedding"], atol=1e-6)
        for bad, why in [({"input": ""}, "an input string must not be empty"),
                         ({"input": []}, "input must not be empty"),
                         ({"input": [[]]}, "an input must hold at least one token"),
                         ({"input": list(range(512))}, "512 tokens is too long: this model "
                                                        "takes up to 511"),
                         ({"input": "x", "dimensions": 8}, "cannot be shortened"),
                         ({"input": "x", "model": "nope"}, "the model 'nope' does not exist")]:
            r = httpx.post(url, json=bad, timeout=60)
            assert r.status_code in (400, 404) and why in r.json()["error"]["message"], r.text
    finally:
        serve.stop()
