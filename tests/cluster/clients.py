"""What the client test module drives its cluster with: an OpenAI Agents SDK model that answers
once a tool has answered, and lm-eval on a local multiple-choice task (no download)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from agents.models.interface import Model

# Four questions, eleven (context, continuation) requests: lm-eval scores every choice.
QUESTIONS = [
    {"question": "What color is the sky?", "choices": [" blue", " green", " red"], "answer": 0},
    {"question": "How many legs has a dog?", "choices": [" four", " two", " six"], "answer": 0},
    {"question": "Which is a fruit?", "choices": [" apple", " chair", " road"], "answer": 0},
    {"question": "Is fire hot?", "choices": [" yes", " no"], "answer": 0},
]
TASK = "baton_tiny_mc"


class AnswerAfterTool(Model):
    """Another model's calls, with tool_choice "none" once the input holds a tool's output:
    the turn after a forced call answers (a random model would otherwise never stop)."""

    def __init__(self, inner: Model) -> None:
        self.inner = inner

    @staticmethod
    def _settings(items, settings):
        answered = isinstance(items, list) and any(
            isinstance(i, dict) and i.get("type") == "function_call_output" for i in items
        )
        return dataclasses.replace(settings, tool_choice="none") if answered else settings

    async def get_response(self, system_instructions, input, model_settings, *args, **kwargs):
        settings = self._settings(input, model_settings)
        return await self.inner.get_response(system_instructions, input, settings, *args, **kwargs)

    def stream_response(self, system_instructions, input, model_settings, *args, **kwargs):
        settings = self._settings(input, model_settings)
        return self.inner.stream_response(system_instructions, input, settings, *args, **kwargs)


def write_task(root: Path) -> Path:
    """A multiple-choice lm-eval task (YAML) over a local JSONL file, in `root`; the
    dataset's cache stays there too."""
    data = root / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (root / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  data_files: {{test: {data}}}\n"
        f"  cache_dir: {root / 'cache'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n"
        "  - metric: acc\n"
        "    aggregation: mean\n"
        "    higher_is_better: true\n"
    )
    return root


def loglikelihoods(task_dir: Path, model: str, model_args: dict, batch_size: int) -> dict:
    """{(doc id, choice): (loglikelihood, is_greedy)} of lm-eval's run of the task."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(task_dir)),
        batch_size=batch_size,
        device="cpu",
        log_samples=True,
    )
    out = {}
    for sample in results["samples"][TASK]:
        for choice, ((logprob, greedy),) in enumerate(sample["resps"]):
            out[(sample["doc_id"], choice)] = (float(logprob), bool(greedy))
    return out
