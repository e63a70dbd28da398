"""The kvpress side of ``perf/kvpress_compare.py``: run by ``.venv-kvpress/bin/python``, never by ``.venv``.

    .venv-kvpress/bin/python perf/kvpress_worker.py JOB.json ANSWERS.json [PROGRESS.jsonl]

JOB.json (written by kvpress_compare.py): ``model`` (checkpoint folder), ``dtype``, ``max_new_tokens``,
``jobs`` (one per policy and keep fraction: ``policy``, ``press`` (a class name in ``kvpress``),
``options`` (its keyword arguments besides ``compression_ratio``), ``keep_fraction``; a ``press`` of
null is the full cache) and ``prompts`` (``context_ids``, ``question_ids``: the exact token ids the
SGLang server gets, tokenized on the project's side).

Every prompt is answered with kvpress's own pipeline code, ``KVPressTextGenerationPipeline._forward``:
the context prefilled under ``press(model)`` (compressed there), the question then run on the
compressed cache at its true positions and the answer generated greedily for at most
``max_new_tokens`` tokens, stopping at the generation config's EOS, decoded with
``skip_special_tokens=True``. Only the pipeline's ``preprocess`` is left out: it would wrap the context
in the chat template (or prepend BOS) and add a suffix after the question, while the project's runner
sends the raw text; the token ids come from the project's side instead, so both servers read the same
tokens. PyramidKVPress leaves the layers with different cache lengths, which transformers' SDPA path
cannot mask (``_align_causal_mask_per_layer`` gives those layers flash attention's end-aligned causal
mask; nothing else changes). ``ObservedAttentionPress`` (H2O) needs the attention weights, so its jobs run on a second copy
of the model loaded with ``attn_implementation="eager"``; every other press runs on SDPA (KVzipPress
refuses eager).

KVzap (issue #57): a job whose ``press`` is ``DMSPress`` carries ``options`` = {"scorer": "KVzapPress",
"model_type": "mlp" | "linear", "surrogate": a folder, "threshold": tau, "sliding_window_size": 128}. The
surrogate is OUR trained one, written in kvpress's ``KVzapModel`` layout (``config.json`` with
``input_dim``, ``output_dim``, ``n_modules``, ``hidden_dim``; ``model.safetensors``): kvpress's
``KVzapModel.from_pretrained`` fails under transformers 5.x (its issue #267), so the folder is read
here into kvpress's own ``KVzapModel`` (built from a ``KVzapConfig``, then ``load_state_dict``), set on a
``KVzapPress`` under the hub name kvpress would derive for the model (``post_init_from_model`` then
loads nothing), and wrapped in ``DMSPress(threshold, sliding_window_size)``, which thresholds the
context's prefill (``decoding`` stays False, as in kvpress's evaluation). After each such answer the
press's own ``compression_ratio`` (the masked share of each layer's cache, averaged over layers) is
recorded as ``kvpress_compression_ratio``.

ANSWERS.json: ``versions`` (kvpress, transformers, torch and where torch was imported from) and
``answers[job][prompt]`` = {"text", "ids"} (the generated ids, EOS included when reached; plus
``kvpress_compression_ratio`` for DMSPress jobs).
Progress (tqdm) on stderr. PROGRESS.jsonl (optional): every answer is appended there as it is made
(``{"job", "prompt", "text", "ids"}``), and answers already there are not made again, so an
interrupted run resumes; the caller names the file after the job, so it never mixes two jobs.
"""

from __future__ import annotations

import json
import os
import sys
from importlib.metadata import version

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _align_causal_mask_per_layer(torch) -> None:
    """Let SDPA serve caches whose layers hold different counts (PyramidKVPress's).

    transformers sizes the attention mask of the question's forward from layer 0's cache; a layer that
    kept fewer entries then fails in SDPA ("size of tensor a (436) must match ... b (448)"). DynamicCache
    supports per-layer lengths only under flash attention (transformers issue 35168), whose causal mask
    for q queries over k keys is aligned to the end (query i sees keys up to k - q + i). Where a layer's
    key count differs from the mask's, that mask is used instead; everywhere else the call is SDPA's
    own, unchanged (kvpress's head-masking patch included)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]  # already wrapped by kvpress's attention_patch at import

    def sdpa_aligned(module, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is not None and attention_mask.shape[-1] != key.shape[-2]:
            q, k = query.shape[-2], key.shape[-2]
            attention_mask = torch.ones(q, k, dtype=torch.bool, device=query.device).tril(k - q)[None, None]
        return sdpa(module, query, key, value, attention_mask, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_aligned


def _kvzap_press(kvpress, torch, options: dict, model_name: str):
    """DMSPress(KVzapPress) with the surrogate of ``options["surrogate"]`` (module docstring)."""
    from safetensors.torch import load_file

    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

    folder = options["surrogate"]
    with open(os.path.join(folder, "config.json")) as f:
        fields = json.load(f)
    config = KVzapConfig(input_dim=fields["input_dim"], output_dim=fields["output_dim"],
                         n_modules=fields["n_modules"], hidden_dim=fields["hidden_dim"])
    surrogate = KVzapModel(config)
    surrogate.load_state_dict(load_file(os.path.join(folder, "model.safetensors")))
    scorer = getattr(kvpress, options["scorer"])(model_type=options["model_type"])
    scorer.kvzap_model = surrogate.eval()
    scorer.kvzap_model_name = f"nvidia/KVzap-{options['model_type']}-{model_name.rstrip('/').split('/')[-1]}"
    return kvpress.DMSPress(press=scorer, threshold=options["threshold"],
                            sliding_window_size=options["sliding_window_size"])


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    job_path, out_path = argv[:2]
    progress_path = argv[2] if len(argv) == 3 else None
    done: dict[tuple[int, int], dict] = {}
    if progress_path and os.path.exists(progress_path):
        with open(progress_path) as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # the last line of a run killed while writing it
                    continue
                done[entry["job"], entry["prompt"]] = {k: v for k, v in entry.items() if k not in ("job", "prompt")}
    with open(job_path) as f:
        job = json.load(f)

    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    import kvpress
    from kvpress.pipeline import KVPressTextGenerationPipeline

    _align_causal_mask_per_layer(torch)

    hf_logging.disable_progress_bar()  # the weight-loading bars; the work's own bar stays
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dtype = getattr(torch, job["dtype"])
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    pipelines: dict[str, KVPressTextGenerationPipeline] = {}

    def pipeline_for(attention: str) -> KVPressTextGenerationPipeline:
        if attention not in pipelines:
            model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=dtype, attn_implementation=attention)
            model.eval()
            pipelines[attention] = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device="cpu")
        return pipelines[attention]

    work = [(j, p) for p in range(len(job["prompts"])) for j in range(len(job["jobs"])) if (j, p) not in done]
    if done:
        print(f"{len(done)} answers kept in {progress_path}; {len(work)} to make", file=sys.stderr)
    progress = open(progress_path, "a") if progress_path else None
    with torch.no_grad():
        for j, p in tqdm(work, desc="kvpress", unit="answer", file=sys.stderr):
            spec, prompt = job["jobs"][j], job["prompts"][p]
            press = None
            if spec["press"] == "DMSPress":
                press = _kvzap_press(kvpress, torch, spec["options"], job["model"])
            elif spec["press"] is not None:
                press = getattr(kvpress, spec["press"])(compression_ratio=1.0 - spec["keep_fraction"], **spec["options"])
            pipe = pipeline_for("eager" if spec["press"] == "ObservedAttentionPress" else "sdpa")
            inputs = {"context_ids": torch.tensor([prompt["context_ids"]]),
                      "questions_ids": [torch.tensor([prompt["question_ids"]])]}
            ids: list[int] = []  # the pipeline's greedy loop decodes its ids once: recorded on the way
            decode = tokenizer.decode

            def recording_decode(token_ids, *args, **kwargs):
                ids.extend(int(t) for t in token_ids)
                return decode(token_ids, *args, **kwargs)

            tokenizer.decode = recording_decode
            try:
                (text,) = pipe._forward(inputs, max_new_tokens=job["max_new_tokens"], press=press)
            finally:
                tokenizer.decode = decode
            done[j, p] = {"text": text, "ids": ids}
            if spec["press"] == "DMSPress":
                done[j, p]["kvpress_compression_ratio"] = float(press.compression_ratio)
            if progress is not None:
                progress.write(json.dumps({"job": j, "prompt": p, **done[j, p]}) + "\n")
                progress.flush()
    if progress is not None:
        progress.close()
    answers = [[done[j, p] for p in range(len(job["prompts"]))] for j in range(len(job["jobs"]))]

    torch_file = torch.__file__
    result = {
        "versions": {"kvpress": version("kvpress"), "transformers": version("transformers"), "torch": torch.__version__,
                     "torch_from": os.path.realpath(torch_file), "python": sys.version.split()[0]},
        "answers": answers,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
