"""The one shared helper module of nanwatch's tests (``from support import ...``; pytest puts tests/ on
the path). Small real models, token ids, the collector as a child process, and a guard for external tools.
Nothing in the product imports this module, and it is not in the wheel."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
import os
import shutil
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.bench.load import synthetic_report as step_report
from nanwatch.bench.serve import CollectorProcess as _CollectorProcess
from nanwatch.bench.serve import free_port
from nanwatch.bench.tiny_models import TINY_QWEN3, tiny_causal_lm, tiny_qwen3

__all__ = ["ADMIN", "SMALL", "TINY_QWEN3", "TOKEN", "VOCAB", "CollectorProcess", "Mixer", "RolloutEngine", "TinyNet",
           "free_port", "guarded_step", "require_tool", "save_tiny_lm", "scrape", "step_report", "tiny_causal_lm", "tiny_moe", "tiny_qwen3",
           "MOE_EXPERTS", "MOE_LAYERS", "MOE_TOP_K", "MOE_VOCAB", "grpo_step", "overflow_attention", "rollout_policy", "step_reports", "tiny_tokenizer", "token_ids", "wait_until"]

#: the tokens of the ``collector`` fixture (conftest.py)
TOKEN, ADMIN = "ingest-secret", "admin-secret"
#: every POST and PUT says what it sends (the collector refuses anything but JSON)
JSON = {"Content-Type": "application/json"}
AUTH = {"Authorization": f"Bearer {TOKEN}", **JSON}
#: vocabulary of the tiny models and of :func:`token_ids`
VOCAB = TINY_QWEN3["vocab_size"]
#: a smaller tiny model than TINY_QWEN3 (hidden 32, head_dim 8), for tests that build many
SMALL = dict(hidden_size=32, intermediate_size=64, head_dim=8, max_position_embeddings=64)


class CollectorProcess(_CollectorProcess):
    """``nanwatch serve`` as a child process, rendering ``/metrics`` without a minimum interval unless
    ``env`` sets one: tests scrape right after each write, and would wait for it (the interval itself is
    tested in test_hardening.py)."""

    def __init__(self, *, env: dict[str, str] | None = None, **kw) -> None:
        super().__init__(env={"NANWATCH_METRICS_MIN_INTERVAL_S": "0", **(env or {})}, **kw)


def step_reports(sink: list, finals: list | None = None):
    """An ``on_report`` that appends every report but the final one (#18: a normal close sends one more, of
    no measurements) to ``sink``, and the final ones to ``finals`` if given."""

    def on_report(r) -> None:
        if not r.final:
            sink.append(r)
        elif finals is not None:
            finals.append(r)

    return on_report


def token_ids(b: int = 2, s: int = 16, *, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    """A ``[b, s]`` batch of random token ids, one fixed batch per seed."""
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


class Mixer(nn.Module):
    """Self-attention by another name: it calls ``F.scaled_dot_product_attention`` itself, and its class
    name matches none of nanwatch's attention patterns, so its site comes from the caller's FQN. Nothing
    in it syncs with the host, so a GPU test can blame any sync on nanwatch."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class TinyNet(nn.Module):
    """Embedding, two residual Mixer blocks, a head: the smallest language-model-shaped net."""

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Mixer(dim), Mixer(dim)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def wait_until(cond, what: str, timeout_s: float = 30.0) -> None:
    """Poll ``cond()`` until it is truthy; fail naming ``what`` after ``timeout_s`` seconds (a bound on a
    process's answer, not a timing that is asserted)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def require_tool(name: str) -> str:
    """Path of an external tool; skip the test when it is missing, or fail if NANWATCH_REQUIRE_TOOLS=1."""
    path = shutil.which(name)
    if path is None:
        msg = f"{name} is not installed"
        if os.environ.get("NANWATCH_REQUIRE_TOOLS") == "1":
            pytest.fail(f"{msg} and NANWATCH_REQUIRE_TOOLS=1")
        pytest.skip(msg)
    return path


def scrape(url: str, token: str = TOKEN, *, settled: bool = True) -> dict[tuple[str, frozenset], float]:
    """``GET {url}/metrics`` parsed by prometheus_client: {(sample name, frozenset(labels)): value}. The
    token is sent as Prometheus would (a tokenless collector ignores it). A counter series new to the
    collector is shown at 0 in the first render after its birth (born at zero, so increase() counts it):
    ``settled`` scrapes twice and returns the second, where every value shows; ``settled=False`` is one
    scrape, as Prometheus sees it."""
    from prometheus_client.parser import text_string_to_metric_families

    def once() -> str:
        req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.read().decode()

    if settled:
        once()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(once()) for s in fam.samples}


WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "plus", "minus",
         "equals", "count", "to", "say", "the", "number"]


def tiny_tokenizer():
    """A word-level tokenizer built here (no download): special tokens <pad>=0, <eos>=1, <unk>=2."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   padding_side="left")


def save_tiny_lm(path, *, seed: int = 0) -> str:
    """A tiny Qwen3 and its tokenizer saved to ``path``: TRL builds its reference model with
    ``from_pretrained(config._name_or_path)``, so a model that must have one has to come from a folder."""
    tok = tiny_tokenizer()
    model = tiny_qwen3("sdpa", seed=seed, vocab_size=64, hidden_size=32, intermediate_size=64,
                       tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=None)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def overflow_attention(model, layer: int = 0, factor: float = 100.0) -> None:
    """Scale a Qwen3 layer's q/k norms, as attention-logit growth does: in fp16 the eager QK matmul then
    overflows and the attention output turns NaN (the demo's failure)."""
    attn = model.model.layers[layer].self_attn
    with torch.no_grad():
        attn.q_norm.weight.mul_(factor)
        attn.k_norm.weight.mul_(factor)


def guarded_step(mon, model, opt, n: int) -> tuple:
    """One training step ``n`` of a tiny causal LM under an attached, guarded Monitor, on the batch
    ``token_ids(2, 32, seed=n, vocab=64)``: (its report, a row of what the weight-guard tests check: the
    mode the step ran in, whether the update was skipped, the loss, whether every weight is finite)."""
    ids = token_ids(2, 32, seed=n, vocab=64)
    with mon.step(n):
        mode = mon.directive_state.mode
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    r = mon.last_report()
    return r, {"step": n, "mode": mode, "skipped": r.step_skipped, "loss": float(loss),
               "weights_finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


def post_reports(url: str, *reports, auth: dict = AUTH) -> dict:
    """POST ``reports`` to a collector in one batch; asserts a 200 and returns its answer."""
    import httpx

    from nanwatch.wire import ReportBatch

    resp = httpx.post(f"{url}/v1/reports", content=ReportBatch(reports=list(reports)).model_dump_json(),
                      headers=auth)
    assert resp.status_code == 200, resp.text
    return resp.json()


def run_view(url: str, run_id: str, auth: dict = AUTH) -> dict:
    """``GET /v1/runs/{run_id}``; asserts a 200."""
    import httpx

    resp = httpx.get(f"{url}/v1/runs/{run_id}", headers=auth)
    assert resp.status_code == 200, resp.text
    return resp.json()


def sample(scraped: dict, name: str, **labels) -> float | None:
    """One sample of a ``scrape()``, by metric name and labels."""
    return scraped.get((name, frozenset(labels.items())))


def load_script(path: Path, name: str):
    """A script that is not a package module (a generator under deploy/ or grafana/), loaded by path, as the
    tests use it (not registered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def background_collector(tmp_path, **settings):
    """A real collector (uvicorn on loopback, in this process, ``BackgroundServer``) on ``tmp_path/c.db``,
    for tests that reach into its store or state; ``settings`` override the quiet defaults."""
    from nanwatch.monitor.server import BackgroundServer
    from nanwatch.monitor.settings import Settings

    s = Settings(**{"host": "127.0.0.1", "port": 0, "db_path": str(tmp_path / "c.db"), "log_level": "warning",
                    **settings})
    with BackgroundServer(s) as srv:
        yield srv


@contextlib.contextmanager
def failing(obj, method: str, exc: Exception):
    """``obj.<method>`` raises ``exc`` while the block runs (a fault injected into a live store)."""
    real = getattr(obj, method)

    def fail(*args, **kwargs):
        raise exc

    setattr(obj, method, fail)
    try:
        yield
    finally:
        setattr(obj, method, real)


def rollout_policy(seed: int = 0) -> torch.nn.Module:
    """A tiny Qwen3 policy for the rollout tests (fp32, its own lm_head)."""
    model = tiny_qwen3("sdpa", seed=seed, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked next-token distributions, as a trained model's are
    return model


class RolloutEngine:
    """The rollout side of an RLHF loop: its own copy of the policy, on its own thread, sampling ``BATCH``
    completions of ``NEW`` tokens with ``generate(output_scores=True)`` and returning their logprobs
    (``nanwatch.hooks.rollout_logprobs``). ``dtype`` and ``lowered`` (module names) set its precision;
    ``temperature`` is applied by its sampler only; ``nan_at``: a step whose logprobs get one NaN."""

    PROMPT, NEW, BATCH = 4, 4, 4

    def __init__(self, policy: torch.nn.Module, *, dtype: torch.dtype | None = None, lowered: tuple[str, ...] = (),
                 temperature: float = 1.0) -> None:
        self.model = copy.deepcopy(policy).eval()
        if dtype is not None:
            self.model.to(dtype)
        for name in lowered:
            module = self.model.get_submodule(name).to(torch.bfloat16)
            module.register_forward_pre_hook(lambda m, a: tuple(x.to(torch.bfloat16) for x in a))
            module.register_forward_hook(lambda m, a, out: out.float())
        self.temperature = temperature
        self.nan_at: int | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-engine")

    def sync(self, policy: torch.nn.Module) -> None:
        """A weight sync: the trainer's weights, cast to the engine's dtypes."""
        state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
        self._thread.submit(self.model.load_state_dict, state).result()

    def sample(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._thread.submit(self._sample, step).result()

    @torch.no_grad()
    def _sample(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + step)
        prompts = torch.randint(1, self.model.config.vocab_size, (self.BATCH, self.PROMPT), generator=g)
        torch.manual_seed(step)
        out = self.model.generate(prompts, do_sample=True, max_new_tokens=self.NEW, temperature=self.temperature,
                                  top_k=0, top_p=1.0, output_scores=True, return_dict_in_generate=True,
                                  pad_token_id=0, eos_token_id=None)
        logprobs = nanwatch.hooks.rollout_logprobs(out).processed  # of the distribution the sampler drew from
        if step == self.nan_at:
            logprobs[1, 2] = math.nan  # a sampler NaN: TRL PR #6693 would neutralise it
        return out.sequences, logprobs

    def close(self) -> None:
        self._thread.shutdown()


#: the tiny MoE's shape: decoder layers (each with a router), experts, experts per token, vocabulary
MOE_LAYERS, MOE_EXPERTS, MOE_TOP_K, MOE_VOCAB = 2, 8, 2, 64


def tiny_moe(seed: int = 0, *, router_scale: float = 1.0):
    """A tiny ``Qwen3MoeForCausalLM`` from a config (#39); ``router_scale`` widens the router logits (large ones
    make bf16 rounding flip near-ties)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=MOE_VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=MOE_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K, max_position_embeddings=128, norm_topk_prob=True)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0).mul_(router_scale)
    return model


def grpo_step(mon, policy: torch.nn.Module, opt: torch.optim.Optimizer, step: int, sequences: torch.Tensor,
              rollout: torch.Tensor) -> None:
    """One GRPO-shaped policy-gradient step on a ``RolloutEngine``'s samples, inside ``mon.step(step)``: the
    trainer's logprobs of the sampled tokens compared with the rollout's (``Monitor.rlhf``), group-normalised
    random rewards as advantages."""
    new = RolloutEngine.NEW
    with mon.step(step):
        logits = policy(sequences).logits[:, -new - 1:-1].float()
        logprobs = logits.log_softmax(-1).gather(-1, sequences[:, -new:, None]).squeeze(-1)
        rewards = torch.randn(sequences.shape[0], generator=torch.Generator().manual_seed(step))
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        mon.rlhf(logprobs=logprobs, rollout_logprobs=rollout, advantages=advantages, input_ids=sequences)
        (-(advantages[:, None] * logprobs).mean()).backward()
        opt.step()
        opt.zero_grad()
