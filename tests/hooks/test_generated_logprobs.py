"""``nanwatch.hooks.rollout_logprobs``: the rollout logprobs of a plain HF ``generate()`` on a tiny Qwen3 built
from a config. Under temperature and top-k the processed set (what the sampler drew from) is the raw one
warped by exactly those processors; without processors (greedy, or sampling at temperature 1 with no top-k)
the two agree, and both agree with a teacher-forced forward of the same model within fp32 noise. The mask is
TRL's completion mask."""

from __future__ import annotations

import pytest
import torch
from support import SMALL, tiny_qwen3, token_ids

import nanwatch.hooks
from nanwatch.hooks.rollout.generated import completion_mask

PAD = 0


@pytest.fixture(scope="module")
def model():
    m = tiny_qwen3("sdpa", seed=3, num_hidden_layers=2, **SMALL).eval()
    m.generation_config.pad_token_id = PAD
    return m


def _generate(model, *, eos=None, **kw):
    prompt = token_ids(3, 6, seed=1)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10,
                             output_scores=True, output_logits=True, return_dict_in_generate=True,
                             eos_token_id=eos, pad_token_id=PAD, **kw)
    return prompt, out


def _teacher_forced(model, sequences: torch.Tensor, c: int) -> torch.Tensor:
    """The same model scoring the same tokens in one forward, as a trainer does."""
    with torch.no_grad():
        logits = model(sequences, attention_mask=torch.ones_like(sequences)).logits.float()
    return torch.log_softmax(logits[:, -c - 1:-1], dim=-1).gather(-1, sequences[:, -c:, None]).squeeze(-1)


def test_temperature_and_top_k_are_in_the_processed_set_and_not_in_the_raw_one(model):
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper

    prompt, out = _generate(model, do_sample=True, temperature=0.7, top_k=5, top_p=1.0)
    lp = nanwatch.hooks.rollout_logprobs(out)
    c = len(out.scores)
    assert lp.processed.shape == lp.raw.shape == lp.mask.shape == (3, c) and c == 10
    assert torch.equal(lp.completion_ids, out.sequences[:, prompt.shape[1]:])
    assert lp.mask.all()  # no EOS given: every generated token is the completion's
    # processed = the raw logits through exactly the sampler's processors (an independent computation)
    warped = [TopKLogitsWarper(5)(None, TemperatureLogitsWarper(0.7)(None, raw.clone())) for raw in out.logits]
    expected = torch.stack([torch.log_softmax(w, -1).gather(-1, lp.completion_ids[:, i:i + 1]).squeeze(-1)
                            for i, w in enumerate(warped)], dim=1)
    torch.testing.assert_close(lp.processed, expected, rtol=0, atol=1e-5)
    # every sampled token is finite under what it was drawn from; a token top-k removed is -inf there
    assert torch.isfinite(lp.processed).all()
    assert all((torch.isfinite(s).sum(-1) == 5).all() for s in out.scores)  # 59 of 64 are -inf there
    # the raw set is what the model itself gives the tokens: the teacher-forced forward's
    torch.testing.assert_close(lp.raw, _teacher_forced(model, out.sequences, c), rtol=0, atol=1e-4)
    # and the two differ by far more than fp32 noise: sharpening raises the likely tokens' logprobs
    diff = lp.processed - lp.raw
    assert diff.abs().mean() > 0.05 and (diff > 0).float().mean() > 0.9


@pytest.mark.parametrize("mode", ["greedy", "temperature_1"])
def test_without_processors_processed_raw_and_the_trainer_agree(model, mode):
    kw = dict(do_sample=False) if mode == "greedy" else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    _, out = _generate(model, **kw)
    lp = nanwatch.hooks.rollout_logprobs(out)
    torch.testing.assert_close(lp.processed, lp.raw, rtol=0, atol=1e-6)
    torch.testing.assert_close(lp.processed, _teacher_forced(model, out.sequences, len(out.scores)), rtol=0,
                               atol=1e-4)
    assert (lp.processed <= 0).all()


def test_the_mask_is_trls_and_stops_after_the_first_eos(model):
    _, first = _generate(model, do_sample=False)
    eos = int(first.sequences[0, -8])  # sequence 0's third generated token: it now ends there
    prompt, out = _generate(model, do_sample=False, eos=eos)
    lp = nanwatch.hooks.rollout_logprobs(out, eos_token_id=[eos], pad_token_id=PAD)
    completion = out.sequences[:, prompt.shape[1]:]
    # TRL's own construction (GRPOTrainer._generate, transformers path)
    is_eos = torch.isin(completion, torch.tensor([eos]))
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
    eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
    trl_mask = (torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1) <= eos_idx.unsqueeze(1)).int()
    assert torch.equal(lp.mask, trl_mask.long())
    assert lp.mask[0].tolist()[:4] == [1, 1, 1, 0]
    assert (lp.processed[lp.mask == 0] == 0).all()  # TRL pads its sampling logprobs with 0.0
    tf = _teacher_forced(model, out.sequences, len(out.scores))
    torch.testing.assert_close(lp.processed[lp.mask == 1], tf[lp.mask == 1], rtol=0, atol=1e-4)


def test_a_pad_that_is_no_eos_ends_the_mask_and_without_scores_it_says_what_to_pass():
    ids = torch.tensor([[5, 7, 1, 0, 0], [5, 0, 0, 0, 0], [5, 6, 7, 8, 9]])
    assert completion_mask(ids, eos_token_id=1, pad_token_id=0).tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0],
                                                                             [1, 1, 1, 1, 1]]
    assert completion_mask(ids).tolist() == [[1] * 5] * 3
    with pytest.raises(ValueError, match="output_scores=True"):
        nanwatch.hooks.rollout_logprobs(object())


def test_the_docs_snippet_runs_and_reads_the_samplers_temperature(capsys):
    """The runnable example of docs/integrations.md: a HF rollout at temperature 0.7 fed to Monitor.rlhf; the
    trainer scores without the temperature, so the slope of rollout on trainer logprobs is about 1/0.7."""
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "integrations.md").read_text()
    code = page.split("<!-- snippet: rollout-logprobs", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/integrations.md", "exec"), {})
    lines = capsys.readouterr().out.split("\n")
    slopes = [float(line.split()[1]) for line in lines if line.strip()]
    assert len(slopes) == 3 and all(1.2 < s < 1.8 for s in slopes), slopes
