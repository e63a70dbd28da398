"""The learned-gate family's checkpoints and real test-split text, for the end-to-end tests."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cell_path(cell: str) -> str:
    return str(ROOT / "weights" / "gated" / cell)


def split_prompt(cell: str, length: int) -> list[int]:
    """Real text of the checkpoint's test split (its manifest names the documents), tokenised by its tokenizer."""
    from transformers import AutoTokenizer

    from sglang_kvx.training.train_gated import load_documents

    manifest = json.loads((Path(cell_path(cell)) / "manifest.json").read_text())
    docs, _ = load_documents(manifest["args"]["sources"].split(","), manifest["args"]["doc_chars"])
    text = {d["id"]: d["text"] for d in docs}[manifest["split"]["test"][0]]
    ids = AutoTokenizer.from_pretrained(cell_path(cell)).encode(text, add_special_tokens=False)
    assert len(ids) >= length
    return ids[:length]


def generate(server, ids: list[int], decode: dict | None, new_tokens: int) -> dict:
    """Greedy generation with log-probabilities, under ``decode`` (None: the server's own step)."""
    payload = {"input_ids": ids, "return_logprob": True,
               "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    if decode is not None:
        payload["sampling_params"]["custom_params"] = {"kvx": {"decode": decode}}
    response = server.generate(payload)
    assert response.status_code == 200, response.text
    return response.json()
