"""Internal requests the extension queues through SGLang's scheduler (KVzip's reconstruction passes,
parents of shared prefixes no client marked)."""

from __future__ import annotations

from array import array


def prefill_only_request(rid: str, input_ids: list[int], compact: bool = False,
                         namespace: tuple[str | None, str | None] | None = None):
    """An internal prefill-only request, shaped like the tokenizer manager's; a parent when ``compact``, in
    the prefix-cache ``namespace`` (extra_key, cache_salt) of the requests it serves."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    sampling = SamplingParams(max_new_tokens=0, custom_params={"kvx": {"compact": compact}})
    sampling.normalize(None)
    return TokenizedGenerateReqInput(
        rid=rid, input_text=None, input_ids=array("q", input_ids), input_embeds=None, mm_inputs=None,
        token_type_ids=None, sampling_params=sampling, return_logprob=False, logprob_start_len=-1,
        top_logprobs_num=0, token_ids_logprob=None, stream=False,
        extra_key=namespace[0] if namespace else None, cache_salt=namespace[1] if namespace else None,
    )
