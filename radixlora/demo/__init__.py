"""The bundled demo: a small Llama model trained to echo its input and one LoRA adapter per task
in radixlora.demo.tasks, in Hugging Face / PEFT format. Trained by scripts/train_demo.py; see
docs/demo.md."""

from __future__ import annotations

from pathlib import Path

from radixlora.demo.tasks import TASKS, Task, format_prompt, sample_inputs

DEMO_DIR = Path(__file__).resolve().parent
DEMO_MODEL_DIR = DEMO_DIR / "model"
DEMO_ADAPTERS: dict[str, Path] = {name: DEMO_DIR / "adapters" / name for name in TASKS}

__all__ = [
    "DEMO_ADAPTERS",
    "DEMO_DIR",
    "DEMO_MODEL_DIR",
    "TASKS",
    "Task",
    "format_prompt",
    "sample_inputs",
]
