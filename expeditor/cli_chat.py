"""``expeditor chat``: questions answered by a model in this process (the in-process
engine, the checkpoint's chat template as the gateway renders it), batched in one run."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from expeditor.cli import app, fail

DEFAULT_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for a good night's sleep.",
    "Explain in one sentence what a KV cache is.",
]


@app.command()
def chat(
    questions: Annotated[
        list[str] | None, typer.Argument(help="User messages, one chat each.")
    ] = None,
    model: Annotated[
        str,
        typer.Option(help="What serve's --model takes: a directory, a GGUF file, a name."),
    ] = "smollm2-135m-instruct",
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16")] = "auto",
    max_tokens: Annotated[int, typer.Option(help="Most tokens per answer.")] = 64,
) -> None:
    """Answer each question greedily with a model run in this process (no daemons)."""
    from expeditor.gateway.chat import load_chat_template
    from expeditor.llm import LLM
    from shared.errors import ConfigError
    from shared.sampling import SamplingParams

    asked = questions or DEFAULT_QUESTIONS
    try:
        llm = LLM(model, dtype=dtype)
    except (ValueError, ConfigError) as exc:
        fail(escape(str(exc)))
    with llm:
        template = load_chat_template(llm.model_dir)
        if template is None:
            fail(f"{model} has no chat template")
        prompts = [
            llm.tokenizer.encode(
                template.render([{"role": "user", "content": q}]), add_special_tokens=False
            ).ids
            for q in asked
        ]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        answers = llm.generate(prompts, params)
        out = Console()
        out.print(f"[bold]{escape(model)}[/bold] ({llm.runner.dtype_note})")
        for question, answer in zip(asked, answers, strict=True):
            out.print(f"[cyan]> {escape(question)}[/cyan]")
            out.print(escape(answer.text.strip()), highlight=False)
