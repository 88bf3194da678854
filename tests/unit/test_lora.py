"""LoRA adapters on the engine (engine_worker/lora.py, models/layers/lora.py): adapters
made with peft on the tiny Llama, random and non-zero, on every module type; requests
of four adapters and of none in one batch each give the tokens of Hugging Face's model
with that adapter merged by peft; the prefix cache never serves one adapter's KV to
another; bad adapters are refused with a message naming why."""

from __future__ import annotations

import json

import pytest
import torch

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.errors import InvalidRequestError
from common.protocol import SamplingParams
from engine_worker.engine import LLMEngine
from engine_worker.lora import AdapterError, Adapters
from engine_worker.models.registry import architecture
from helpers import random_prompts
from hf_reference import _greedy, assert_matches, hf_model
from lora_adapters import make_adapter, merged_greedy

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (name, rank, alpha, target modules, rsLoRA)
ADAPTERS = [("every", 8, 16, MODULES, False), ("qv", 4, 8, ["q_proj", "v_proj"], False),
            ("mlp", 16, 8, ["gate_proj", "up_proj", "down_proj"], False),
            ("rs", 8, 4, MODULES, True)]
PROMPTS = random_prompts([7, 19, 12], seed=51)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(tiny_llama_dir, root / name, i, rank, alpha, modules, rs)
            for i, (name, rank, alpha, modules, rs) in enumerate(ADAPTERS)}


def engine(model_dir, adapters=(), cpu_kernels=True, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model_dir), device="cpu", cpu_kernels=cpu_kernels,
        lora_modules=tuple((n, str(p)) for n, p in adapters), **kw,
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_batch_size=32, max_num_batched_tokens=64)))


def run(e: LLMEngine, jobs: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    for i, (prompt, params) in enumerate(jobs):
        e.add_request(f"r{i}", prompt, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(jobs))}
    while e.has_unfinished_requests():
        for o in e.step():
            assert o.error is None, o.error
            out[o.request_id] += o.new_token_ids
    return list(out.values())


def greedy(n: int, adapter=None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, adapter=adapter,
                          **kw)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_four_adapters_and_the_base_in_one_batch_match_peft_merged(
        tiny_llama_dir, adapters, cpu_kernels):
    """Every module type, ranks 4 to 16, alpha scaling and rsLoRA; the rows of each
    adapter grouped within one step (the C kernels' packed base weights, and torch's)."""
    refs = {name: merged_greedy(tiny_llama_dir, path, PROMPTS, 8)
            for name, path in adapters.items()}
    refs[None] = _greedy(hf_model(tiny_llama_dir), PROMPTS, 8)
    # each adapter changes the output (a test of adapters that do nothing proves none)
    assert all(refs[n][0].token_ids != refs[None][0].token_ids for n in adapters)
    e = engine(tiny_llama_dir, adapters.items(), cpu_kernels)
    names = [*adapters, None]
    jobs = [(p, greedy(8, name)) for name in names for p in PROMPTS]
    got = run(e, jobs)
    for k, name in enumerate(names):
        assert_matches(got[k * len(PROMPTS):(k + 1) * len(PROMPTS)], refs[name], str(name))
    assert e.stats().num_blocks_used == 0
    assert all(a.users == 0 for a in e.adapters.by_name.values())


def test_the_prefix_cache_never_serves_one_adapters_kv_to_another(tiny_llama_dir, adapters):
    e = engine(tiny_llama_dir, [("every", adapters["every"]), ("qv", adapters["qv"])])
    prompt = PROMPTS[1]   # 19 tokens: 4 full blocks of 4

    def hits(params) -> int:
        before = e.scheduler.prefix_cache_hit_tokens
        tokens = run(e, [(prompt, params)])[0]
        return e.scheduler.prefix_cache_hit_tokens - before, tokens

    first = hits(greedy(6, "every"))
    assert first[0] == 0
    assert hits(greedy(6, "every")) == (16, first[1])       # its own KV, reused
    assert hits(greedy(6, "qv"))[0] == 0                    # another adapter's: not
    assert hits(greedy(6))[0] == 0                          # the base model's: not
    assert hits(greedy(6, "every", cache_salt="s"))[0] == 0  # salted apart too


def test_bad_adapters_are_refused_with_the_reason(tiny_llama_dir, tiny_llama_hd8_dir,
                                                 adapters, tmp_path):
    e = engine(tiny_llama_dir, max_lora_rank=8, max_loras=2)
    with pytest.raises(AdapterError, match="is not a LoRA adapter folder"):
        e.adapters.load("a", str(tmp_path / "missing"))
    with pytest.raises(AdapterError, match=r"rank 16 \(layers.0.mlp.gate_proj\) is above "
                                           r"this engine's --max-lora-rank 8"):
        e.adapters.load("a", str(adapters["mlp"]))
    other = make_adapter(tiny_llama_hd8_dir, tmp_path / "other", 0, 4, 8, ["q_proj"], False)
    with pytest.raises(AdapterError, match="is not an adapter of this model: "
                                           "layers.0.self_attn.q_proj has A"):
        e.adapters.load("a", str(other))
    config = json.loads((adapters["qv"] / "adapter_config.json").read_text())
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_model.safetensors").write_bytes(
        (adapters["qv"] / "adapter_model.safetensors").read_bytes())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="DoRA is not served"):
        e.adapters.load("a", str(dora))
    with pytest.raises(AdapterError, match="an adapter's name is 1 to 128 characters"):
        e.adapters.load("a b", str(adapters["qv"]))
    e.adapters.load("qv", str(adapters["qv"]))
    with pytest.raises(AdapterError, match="'qv' is loaded already"):
        e.adapters.load("qv", str(adapters["qv"]))
    e.adapters.load("every", str(adapters["every"]))
    with pytest.raises(AdapterError, match="2 adapters are loaded, the most"):
        e.adapters.load("rs", str(adapters["rs"]))
    with pytest.raises(InvalidRequestError, match="the model 'nope' does not exist"):
        e.add_request("x", PROMPTS[0], greedy(4, "nope"))
    assert not e.requests


def test_malformed_lora_modules_flags_are_refused_naming_the_spec():
    from engine_worker.__main__ import build_parser, engine_config_from_args

    def modules(*specs: str):
        args = build_parser().parse_args(["--lora-modules", *specs])
        return engine_config_from_args(args).lora_modules

    assert modules("a=/x", "b=/y=z") == (("a", "/x"), ("b", "/y=z"))
    for spec in ("a", "a=", "=/x"):
        with pytest.raises(ValueError, match=f"^--lora-modules takes NAME=PATH, got "
                                             f"'{spec}'$"):
            modules("b=/y", spec)
    with pytest.raises(ValueError, match="^--lora-modules names the adapter 'a' twice$"):
        modules("a=/x", "b=/y", "a=/z")


def test_a_model_split_over_ranks_loads_no_adapter(tiny_llama_dir, adapters):
    e = engine(tiny_llama_dir)
    split = Adapters(e.runner.model, architecture(e.model_config.architecture),
                     e.model_config.checkpoint_prefixes, 2, 8, e.device, e.runner.dtype,
                     split=True)
    with pytest.raises(AdapterError, match="^LoRA adapters are not served with the model "
                                           "split over tensor-parallel ranks yet$"):
        split.load("qv", str(adapters["qv"]))
    assert "qv" not in split and split.free_slots == [1, 2]


def test_an_adapter_unloaded_in_use_finishes_its_requests_first(tiny_llama_dir, adapters):
    e = engine(tiny_llama_dir, [("every", adapters["every"])], max_loras=1)
    expected = run(e, [(PROMPTS[0], greedy(8, "every"))])[0]
    e.block_manager.reset_prefix_cache()
    e.add_request("busy", PROMPTS[0], greedy(8, "every"))
    got = [t for o in e.step() for t in o.new_token_ids]
    assert e.adapters.unload("every")
    with pytest.raises(InvalidRequestError, match="does not exist"):
        e.add_request("late", PROMPTS[0], greedy(8, "every"))
    while e.has_unfinished_requests():
        got += [t for o in e.step() for t in o.new_token_ids]
    assert got == expected
    assert "every" not in e.adapters and e.adapters.free_slots == [1]
    e.adapters.load("rs", str(adapters["rs"]))   # its slot taken by another
    assert e.adapters.by_name["rs"].slot == 1
    # (the C forward's weights for the slot are the new adapter's)
    assert run(e, [(PROMPTS[0], greedy(8, "rs"))])[0] == merged_greedy(
        tiny_llama_dir, adapters["rs"], PROMPTS[:1], 8)[0].token_ids


def test_an_embedding_runs_with_its_adapter(tiny_llama_dir, adapters):
    """/v1/embeddings naming an adapter: the hidden states of the model with the adapter
    merged by peft, beside the base model's in the same step."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[1]
    e = engine(tiny_llama_dir, [("every", adapters["every"])])
    e.add_request("base", prompt, SamplingParams(max_tokens=1, embed=True))
    e.add_request("lora", prompt, SamplingParams(max_tokens=1, embed=True, adapter="every"))
    outs = {}
    while e.has_unfinished_requests():
        outs.update({o.request_id: o.embedding for o in e.step()})
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapters["every"]).merge_and_unload().eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for name, model in (("lora", merged), ("base", plain)):
        with torch.no_grad():
            h = model.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        ref = torch.nn.functional.normalize(h, dim=0)
        assert float(torch.tensor(outs[name]) @ ref) >= 0.9999, name
    assert outs["lora"] != outs["base"]


@pytest.mark.parametrize("model", ["granite", "phi4_mini", "gemma3"])
def test_the_one_call_cpu_forward_applies_adapters_as_peft_merges_them(request, model,
                                                                      tmp_path):
    """The C forward's own products (cpu/csrc/llama.c), never the layer-by-layer path:
    a residual multiplier folded into B (Granite), q/k/v and gate/up stored fused with
    a partial RoPE's reordered rows (Phi-4-mini), norms of o's and down's outputs after
    the adapter's product (Gemma 3); two adapters and the base model in one batch."""
    model_dir = request.getfixturevalue(f"tiny_{model}_dir")
    modules = (["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if model == "phi4_mini"
               else MODULES)
    alpha = 64 if model == "granite" else 8   # (Granite's residual branches are x0.22)
    made = {"a": make_adapter(model_dir, tmp_path / "a", 1, 8, alpha, modules, False),
            "b": make_adapter(model_dir, tmp_path / "b", 2, 4, alpha // 2, modules[1:], True)}
    refs = {name: merged_greedy(model_dir, path, PROMPTS, 6)
            for name, path in {**made, None: None}.items()}
    assert all(any(r.token_ids != base.token_ids for r, base in zip(refs[n], refs[None]))
               for n in made)   # (each adapter changes some tokens)
    # (Phi-4-mini's short factors, as Hugging Face's at these lengths)
    e = engine(model_dir, made.items(), max_model_len=64 if model == "phi4_mini" else None)
    eager = e.runner.eager.run
    e.runner.eager.run = lambda *a: pytest.fail("a step ran layer by layer")
    names = [*made, None]
    got = run(e, [(p, greedy(6, name)) for name in names for p in PROMPTS])
    e.runner.eager.run = eager
    for k, name in enumerate(names):
        assert_matches(got[k * len(PROMPTS):(k + 1) * len(PROMPTS)], refs[name], str(name))


def test_an_adapter_on_a_mixtures_shared_expert_runs_layer_by_layer(tiny_qwen2_moe_dir,
                                                                    tmp_path):
    """The C forward does not apply adapters to a mixture's shared expert: a step with
    such an adapter's rows runs layer by layer (the modules apply it), one with only the
    base model's rows runs in C; both as peft's merge computes them."""
    modules = r".*(self_attn\.(q|v)_proj|shared_expert\.(gate|up|down)_proj)"
    made = make_adapter(tiny_qwen2_moe_dir, tmp_path / "shared", 3, 8, 16, modules, False)
    refs = {name: merged_greedy(tiny_qwen2_moe_dir, path, PROMPTS, 6)
            for name, path in (("shared", made), (None, None))}
    assert any(r.token_ids != base.token_ids for r, base in zip(refs["shared"], refs[None]))
    e = engine(tiny_qwen2_moe_dir, [("shared", made)])
    calls = []
    eager = e.runner.eager.run
    e.runner.eager.run = lambda *a: calls.append(1) or eager(*a)
    assert_matches(run(e, [(p, greedy(6)) for p in PROMPTS]), refs[None], "base")
    assert not calls   # (the base model alone: the one C call)
    assert_matches(run(e, [(p, greedy(6, "shared")) for p in PROMPTS]), refs["shared"],
                   "shared")
    assert calls
