"""Train the bundled demo (radixlora/demo): a small Llama model with a byte-level BPE tokenizer,
trained to echo its input, and one PEFT LoRA adapter per task of radixlora.demo.tasks. Runs on
the CPU, deterministically (fixed seeds, one thread, deterministic algorithms), then measures
every adapter and the base on held-out inputs through radixlora's Engine.

    nice -n 10 .venv/bin/python scripts/train_demo.py   # rewrites radixlora/demo/{model,adapters}

Needs transformers and peft (the test extras)."""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checkpoints import SPECIALS, TARGETS, build_tokenizer, hf_config  # noqa: E402

from radixlora.demo.tasks import TASKS, format_prompt, sample_inputs  # noqa: E402

PAD, BOS, EOS = 0, 1, 2
# tool results read as inputs; an assistant's calls in Hermes' format (<tool_call>), the one
# the server then finds in its outputs
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] in ('user', 'tool') %}"
    "input: {{ message['content'] }}\noutput:\n"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>{{ call['function'] | tojson }}"
    "</tool_call>{% endfor %}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    steps: int


# heterogeneous ranks on purpose; steps are what each task needs to reach ~100% held-out
ADAPTERS = {
    "upper": AdapterSpec(rank=8, steps=300),
    "reverse": AdapterSpec(rank=16, steps=700),
    "digits": AdapterSpec(rank=16, steps=1600),
    "json": AdapterSpec(rank=4, steps=300),
}


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    vocab_size: int = 1024  # BPE merges stop earlier (~850); the model rounds up to 64
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 3
    base_steps: int = 1200
    base_lr: float = 3e-3
    adapter_lr: float = 5e-3
    steps_scale: float = 1.0  # < 1 for a quick smoke run
    batch_size: int = 32
    train_inputs: int = 20000
    eval_inputs: int = 300

    def steps(self, steps: int) -> int:
        return max(1, round(steps * self.steps_scale))


# ---- determinism, tokenizer, model files -----------------------------------------------------


def make_deterministic(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(1)  # CPU reductions may split differently across thread counts
    torch.use_deterministic_algorithms(True)


def quiet_libraries() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)


def tokenizer_corpus(inputs: list[str]) -> list[str]:
    texts = []
    for text in inputs:
        texts.append(format_prompt(text))
        texts.extend(task.solve(text) for task in TASKS.values())
    return texts


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": SPECIALS[PAD],
        "bos_token": SPECIALS[BOS],
        "eos_token": SPECIALS[EOS],
        "add_bos_token": False,
        "model_max_length": 256,
        "chat_template": CHAT_TEMPLATE,
    }


def model_config(vocab_size: int, cfg: TrainConfig):
    return hf_config(
        "llama",
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.05,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )


# ---- data ------------------------------------------------------------------------------------


def base_pairs(inputs: list[str], rng: random.Random) -> list[tuple[str, str]]:
    """Echo: half the inputs as they are, half already in one task's output style, so the base
    knows every output token yet never performs a task."""
    styles = [None, *TASKS.values()]
    pairs = []
    for text in inputs:
        style = rng.choice(styles) if rng.random() < 0.5 else None
        shown = text if style is None else style.solve(text)
        pairs.append((format_prompt(shown), shown))
    return pairs


def task_pairs(task_name: str, inputs: list[str]) -> list[tuple[str, str]]:
    task = TASKS[task_name]
    return [(format_prompt(text), task.solve(text)) for text in inputs]


def encode_pairs(tok, pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + EOS), each side tokenized alone as the Engine sees them."""
    return [(tok.encode(prompt).ids, tok.encode(answer).ids + [EOS]) for prompt, answer in pairs]


def collate(examples: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """Right-padded input_ids / attention_mask, labels only on the answer tokens."""
    width = max(len(p) + len(a) for p, a in examples)
    ids = torch.full((len(examples), width), PAD)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100)
    for row, (prompt, answer) in enumerate(examples):
        seq = prompt + answer
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        labels[row, len(prompt) : len(seq)] = torch.tensor(answer)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def batches(examples, batch_size: int, steps: int, rng: random.Random):
    order: list[int] = []
    for _ in range(steps):
        if len(order) < batch_size:
            order += rng.sample(range(len(examples)), len(examples))
        chosen, order = order[:batch_size], order[batch_size:]
        yield collate([examples[i] for i in chosen])


# ---- training --------------------------------------------------------------------------------


def lr_at(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, examples, steps: int, lr: float, cfg: TrainConfig, label: str) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(f"{cfg.seed}-{label}")
    model.train()
    start = time.perf_counter()
    for step, batch in enumerate(batches(examples, cfg.batch_size, steps, rng)):
        for group in optim.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        loss = model(**batch).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        if step % 200 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - start
            print(f"  [{label}] step {step:5d}/{steps} loss {loss.item():.4f} {elapsed:6.1f}s")
    model.eval()


def train_base(out: Path, tok, train_inputs: list[str], cfg: TrainConfig) -> Path:
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    vocab = math.ceil(tok.get_vocab_size() / 64) * 64
    model = LlamaForCausalLM(model_config(vocab, cfg)).float()
    pairs = base_pairs(train_inputs, random.Random(cfg.seed + 1))
    train(model, encode_pairs(tok, pairs), cfg.steps(cfg.base_steps), cfg.base_lr, cfg, "base")
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    model_dir = out / "model"
    shutil.rmtree(model_dir, ignore_errors=True)
    model.save_pretrained(model_dir)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), indent=2) + "\n"
    )
    return model_dir


def train_adapter(model_dir: Path, out: Path, tok, task: str, inputs, cfg: TrainConfig) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed + 100 + list(TASKS).index(task))
    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    spec = ADAPTERS[task]
    lora = LoraConfig(
        r=spec.rank, lora_alpha=2 * spec.rank, lora_dropout=0.0, target_modules=list(TARGETS)
    )
    model = get_peft_model(base, lora)
    examples = encode_pairs(tok, task_pairs(task, inputs))
    train(model, examples, cfg.steps(spec.steps), cfg.adapter_lr, cfg, task)
    adapter_dir = out / "adapters" / task
    shutil.rmtree(adapter_dir, ignore_errors=True)
    model.save_pretrained(adapter_dir)
    _tidy_adapter(adapter_dir)
    return adapter_dir


def _tidy_adapter(adapter_dir: Path) -> None:
    """Drop PEFT's generated model card and the absolute base path it records; sort
    target_modules (PEFT writes a set, ordered by the per-process string hash)."""
    (adapter_dir / "README.md").unlink(missing_ok=True)
    config_path = adapter_dir / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = "radixlora/demo/model"
    config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# ---- evaluation through radixlora ------------------------------------------------------------

STACK = (("upper", 1.0), ("reverse", 1.0))  # never trained together; reported, not required


def generate_mixed(engine, inputs: list[str], specs: list) -> list[list[str]]:
    """Greedy outputs per spec, from one batch interleaving every spec request by request."""
    from radixlora import SamplingParams

    prompts = [format_prompt(text) for text in inputs for _ in specs]
    routing = [spec for _ in inputs for spec in specs]
    outs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0), routing)
    texts = [out.outputs[0].text for out in outs]
    return [texts[k :: len(specs)] for k in range(len(specs))]


def score(inputs: list[str], answers: list[str]) -> dict[str, float]:
    """Fraction of answers that echo the input, and that pass each task's checker."""
    hits = {"echo": sum(x == y.strip() for x, y in zip(inputs, answers))}
    for task in TASKS.values():
        hits[task.name] = sum(task.check(x, y) for x, y in zip(inputs, answers))
    return {name: n / len(inputs) for name, n in hits.items()}


def evaluate(model_dir: Path, adapter_dirs: dict[str, Path], count: int, seed: int) -> None:
    from radixlora import Engine

    engine = Engine(model_dir, adapters=adapter_dirs, kv_pages=16384, max_running=256)
    inputs = sample_inputs(count, seed, heldout=True)
    specs = [None, *adapter_dirs, list(STACK)]
    answers = generate_mixed(engine, inputs, specs)
    columns = ["echo", *TASKS]
    print(f"held-out exact match on {count} inputs (rows: what served, columns: checker)")
    print(f"{'':>10}" + "".join(f"{c:>10}" for c in columns))
    for spec, outs in zip(specs[:-1], answers):
        scores = score(inputs, outs)
        print(f"{spec or 'base':>10}" + "".join(f"{scores[c]:>10.3f}" for c in columns))
    composed = sum(
        y.strip() == TASKS["upper"].solve(TASKS["reverse"].solve(x))
        for x, y in zip(inputs, answers[-1])
    )
    print(f"stack upper+reverse gives upper(reverse(input)) on {composed / count:.3f}")


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent.parent / "radixlora" / "demo"
    )
    parser.add_argument(
        "--steps-scale",
        type=float,
        default=1.0,
        help="multiply every step count (e.g. 0.05 for a smoke run)",
    )
    parser.add_argument("--eval-only", action="store_true")
    args = parser.parse_args(argv)
    cfg = TrainConfig(steps_scale=args.steps_scale)
    make_deterministic(cfg.seed)
    quiet_libraries()
    start = time.perf_counter()
    model_dir = args.out / "model"
    if not args.eval_only:
        train_inputs = sample_inputs(cfg.train_inputs, cfg.seed, heldout=False)
        tok = build_tokenizer(tokenizer_corpus(train_inputs), cfg.vocab_size)
        model_dir = train_base(args.out, tok, train_inputs, cfg)
        for task in ADAPTERS:
            train_adapter(model_dir, args.out, tok, task, train_inputs, cfg)
        print(f"trained in {time.perf_counter() - start:.0f}s")
    adapters = {task: args.out / "adapters" / task for task in ADAPTERS}
    evaluate(model_dir, adapters, cfg.eval_inputs, cfg.seed + 7)
    print(
        f"sizes: model {dir_size(model_dir) / 1e6:.2f} MB, adapters "
        f"{dir_size(args.out / 'adapters') / 1e6:.2f} MB"
    )


if __name__ == "__main__":
    main()
