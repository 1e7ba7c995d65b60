"""Which distribution SGLang's returned logprobs describe at the pinned version, and that gyre matches it.

At sglang 0.5.23 (sglang/srt/layers/sampler.py, Sampler.forward, standard path):
  logits.div_(temperatures); probs = softmax(logits); sample (top-k/top-p/min-p filter a copy);
  output_token_logprobs = log(probs)   -> tempered, truncation ignored (rl.logprob_distribution=tempered)
With `return_sampling_mask` the selected token's `output_token_sampling_logprobs` is
  log(selected_weight / support_mass) over the filtered weights -> truncated (rl.logprob_distribution=truncated).
Greedy requests (temperature < 1e-6) become temperature 1, top-k 1 (SamplingParams.__post_init__), and
SGLANG_RETURN_ORIGINAL_LOGPROB=1 returns log_softmax of the untempered logits (gyre refuses it).
"""

from __future__ import annotations

import re

import pytest
import torch
from sglang_io import load_io_struct, load_sampler_function, load_sampling_params, sglang_root

from gyre.engine.sglang_backend import ORIGINAL_LOGPROB_ENV, sglang_env
from gyre.train.sampling_logprobs import TokenSampling, sampled_token_logprobs

pytestmark = pytest.mark.unit


def _source(rel: str) -> str:
    return (sglang_root() / rel).read_text()


def test_the_fields_gyre_uses_exist_in_sglangs_request_and_response():
    io = load_io_struct()
    fields = io.GenerateReqInput.__dataclass_fields__
    assert {"return_logprob", "return_sampling_mask", "sampling_logprobs_mode"} <= set(fields)
    params = load_sampling_params()(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05)
    params.verify(vocab_size=1000)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.7, 0.9, 20, 0.05)
    greedy = load_sampling_params()(temperature=0.0)
    assert (greedy.temperature, greedy.top_k) == (1.0, 1)  # what gyre/train/sampling_logprobs.py assumes
    manager = _source("srt/managers/tokenizer_manager.py")
    for key in ("output_token_logprobs", "output_token_sampling_logprobs"):
        assert f'meta_info["{key}"]' in manager or f'"{key}"' in manager, key


def test_sglang_returns_tempered_logprobs_unless_told_otherwise():
    forward = _source("srt/layers/sampler.py")
    standard = forward[forward.index("# Standard path: do softmax and sample from probs.") :]
    standard = standard[: standard.index("if return_logprob:\n            if target_logprobs")]
    steps = [standard.index(s) for s in ("logits.div_(sampling_info.temperatures)", "sampler_softmax(logits)",
                                         "self._sample_from_probs(", "else torch.log(probs)")]  # fmt: skip
    assert steps == sorted(steps), "SGLang's sampler no longer returns log(softmax(logits / T)); re-read it"
    assert re.search(r"SGLANG_RETURN_ORIGINAL_LOGPROB\s*=\s*get_bool_env_var", forward)
    with pytest.raises(ValueError, match="unset it"):
        sglang_env({ORIGINAL_LOGPROB_ENV: "1"})
    assert sglang_env({ORIGINAL_LOGPROB_ENV: "false"})[ORIGINAL_LOGPROB_ENV] == "false"


def test_sglangs_own_filter_gives_the_truncated_logprobs_the_trainer_computes():
    """SGLang's pytorch-backend filter, run from its source, and its support-mass formula for the selected
    token (Sampler._build_sampling_mask_output) against gyre's truncated definition."""
    sgl_filter = load_sampler_function("top_k_top_p_min_p_sampling_from_probs_torch")
    torch.manual_seed(0)
    n, v = 64, 50
    logits = torch.randn(n, v) * 3
    temperature = torch.tensor([0.7, 1.6] * (n // 2))
    top_p = torch.tensor([0.9, 1.0, 0.6, 0.95] * (n // 4))
    top_k = torch.tensor([v, 5, 12, 1] * (n // 4))
    min_p = torch.tensor([0.0, 0.05, 0.0, 0.1] * (n // 4))
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    ids, weights, order, selected = sgl_filter(probs.clone(), top_k, top_p, min_p, True, None, None,
                                               return_filtered_probs=True)  # fmt: skip
    sgl_logprob = torch.log(selected / weights.sum(dim=-1))
    ours = sampled_token_logprobs(logits, ids.long(), TokenSampling(temperature, top_p, top_k, min_p, True))
    torch.testing.assert_close(ours, sgl_logprob, atol=1e-5, rtol=0)
    tempered = sampled_token_logprobs(logits, ids.long(), TokenSampling(temperature, top_p, top_k, min_p, False))
    torch.testing.assert_close(tempered, torch.log(probs.gather(1, ids.long()[:, None])[:, 0]), atol=1e-5, rtol=0)
    assert (ours - tempered).abs().max() > 0.1  # the two definitions differ where truncation bites
