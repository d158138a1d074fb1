"""Forms of the web UI. Validation rules live in ``scheduler.services``; the form
parses text into values and shows the service's field errors next to the fields."""

from __future__ import annotations

from typing import Any, ClassVar, cast

from django import forms
from django.conf import settings

from portal import units
from scheduler import classes, services


def parse_duration(text: str) -> int | None:
    """``portal.units.parse_duration`` with the form's error."""
    try:
        return units.parse_duration(text)
    except ValueError as exc:
        raise forms.ValidationError(str(exc), code="invalid") from None


format_duration = units.format_duration


def parse_memory_mib(text: str) -> int | None:
    """``portal.units.parse_memory_mib`` with the form's error."""
    try:
        return units.parse_memory_mib(text)
    except ValueError as exc:
        raise forms.ValidationError(str(exc), code="invalid") from None


def parse_env(text: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise forms.ValidationError(
                f"Line {lineno}: write KEY=VALUE.", code="invalid"
            )
        env[key.strip()] = value
    return env


class JobForm(forms.Form):
    # Required-ness of name and command is checked by the service, so that one
    # submission shows every problem at once.
    name = forms.CharField(max_length=128, required=False)
    command = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 4, "spellcheck": "false"}),
        # The service enforces the real limit with a clear message; this only stops
        # absurd bodies early.
        max_length=200_000,
        required=False,
        strip=False,
        help_text="Run by /bin/sh in your working directory, e.g. "
        "<code>python train.py --epochs 10</code>.",
    )
    workdir = forms.CharField(
        label="Working directory", max_length=1024, required=False
    )
    gpus = forms.IntegerField(label="GPUs", initial=1, min_value=1, max_value=64)
    gpu_model = forms.ChoiceField(
        label="GPU model",
        required=False,
        help_text="Only GPUs of this model. Optional.",
    )
    gpu_memory = forms.CharField(
        label="GPU memory", required=False, help_text="Per GPU, e.g. 12G. Optional."
    )
    time_limit = forms.CharField(
        label="Time limit",
        required=False,
        help_text="e.g. 4h, 90m, 1d12h. Empty: the class default.",
    )
    priority_class = forms.ChoiceField(label="Class")
    group = forms.ChoiceField(
        required=False, help_text="The group charged for the job."
    )
    shareable = forms.BooleanField(
        required=False,
        label="May share a GPU",
        help_text="Allow another job on the same GPU when both gain.",
    )
    slowdown_cap = forms.FloatField(
        label="Max slowdown when sharing",
        required=False,
        min_value=1.0,
        help_text="e.g. 1.2 (at most 20% slower than alone). Empty: the class's cap.",
    )
    on_partner_hurt = forms.ChoiceField(
        label="If its GPU partner suffers",
        choices=[
            ("requeue", "requeue this job"),
            ("keep", "keep it running"),
        ],
        initial="requeue",
        required=False,  # absent: requeue
        help_text="When a job measured over its cap shares a GPU with this one, "
        "and this one joined later: send this one back to the queue, or keep it.",
    )
    workload = forms.CharField(
        label="Workload label",
        required=False,
        max_length=128,
        help_text="Model family, e.g. resnet50-bs64 (helps predictions).",
    )
    kill_grace = forms.CharField(
        label="Stop grace",
        required=False,
        help_text="Time between SIGTERM and SIGKILL when the job is stopped, "
        "e.g. 30s, 2m. Empty: the default.",
    )
    checkpointable = forms.BooleanField(
        required=False,
        label="Checkpointable",
        help_text="The job saves checkpoints and resumes from the last one: "
        "preempted, it gets the signal below, the grace to save and exit, and is "
        "requeued (GPULAB_RESTART_COUNT tells it how many times).",
    )
    checkpoint_signal = forms.ChoiceField(
        label="Checkpoint signal",
        required=False,
        choices=[(n, f"SIG{n}") for n in services.CHECKPOINT_SIGNALS],
        initial="TERM",
        help_text="Sent first when the job is preempted; it should save a "
        "checkpoint and exit.",
    )
    checkpoint_grace = forms.CharField(
        label="Checkpoint grace",
        required=False,
        help_text="Time from the checkpoint signal to SIGKILL, e.g. 60s, 2m. "
        "Empty: 60 s.",
    )
    on_node_loss = forms.ChoiceField(
        label="If its node is lost",
        choices=[("requeue", "requeue the job"), ("fail", "fail the job")],
        initial="requeue",
        required=False,  # absent: requeue
    )
    after = forms.CharField(
        label="Run after",
        required=False,
        max_length=2000,
        help_text="Start only after other jobs end, e.g. <code>afterok:12</code>, "
        "<code>afterany:12:13</code>, <code>afternotok:a7</code> (a7: every task "
        "of array 7). Optional.",
    )
    env = forms.CharField(
        label="Environment",
        required=False,
        widget=forms.Textarea(attrs={"rows": 3, "spellcheck": "false"}),
        help_text="One KEY=VALUE per line.",
    )

    def __init__(
        self,
        *args: Any,
        group_names: list[str],
        default_group: str = "",
        gpu_models: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        cast("forms.ChoiceField", self.fields["gpu_model"]).choices = [
            ("", "any"),
            *((m, m) for m in gpu_models or []),
        ]
        cast(
            "forms.ChoiceField", self.fields["priority_class"]
        ).choices = classes.class_choices()
        self.fields["priority_class"].initial = settings.GPULAB_DEFAULT_CLASS
        # Empty: the group the service charges by default, named when known.
        default = f"default ({default_group})" if default_group else "default"
        cast("forms.ChoiceField", self.fields["group"]).choices = [("", default)] + [
            (g, g) for g in group_names
        ]
        self.fields["workdir"].widget.attrs["placeholder"] = (
            settings.GPULAB_DEFAULT_WORKDIR
        )

    def clean_gpu_memory(self) -> int | None:
        return parse_memory_mib(self.cleaned_data["gpu_memory"])

    def clean_time_limit(self) -> int | None:
        return parse_duration(self.cleaned_data["time_limit"])

    def clean_kill_grace(self) -> int | None:
        text = self.cleaned_data["kill_grace"].strip().lower()
        if text.isascii() and text.isdigit() and len(text) <= 12:
            return int(text)  # plain seconds here, unlike time limits
        return parse_duration(text)

    def clean_checkpoint_grace(self) -> int | None:
        text = self.cleaned_data["checkpoint_grace"].strip().lower()
        if text.isdigit():
            return int(text)  # plain seconds, as the stop grace
        return parse_duration(text)

    def clean_env(self) -> dict[str, str]:
        return parse_env(self.cleaned_data["env"])

    def to_request(self) -> services.JobRequest:
        data = self.cleaned_data
        return services.JobRequest(
            name=data["name"],
            command=data["command"],
            workdir=data["workdir"],
            env=data["env"],
            gpus=data["gpus"],
            gpu_memory_mib=data["gpu_memory"],
            time_limit_s=data["time_limit"],
            priority_class=data["priority_class"],
            shareable=data["shareable"],
            workload=data["workload"],
            group=data["group"],
            kill_grace_s=data["kill_grace"],
            gpu_model=data["gpu_model"],
            requeue_on_node_loss=data["on_node_loss"] != "fail",
            slowdown_cap=data["slowdown_cap"],
            evictable=data["on_partner_hurt"] != "keep",
            after=data["after"],
            checkpointable=data["checkpointable"],
            checkpoint_signal=data["checkpoint_signal"],
            checkpoint_grace_s=data["checkpoint_grace"],
        )

    # Service field names -> form field names.
    FIELD_MAP: ClassVar[dict[str, str]] = {
        "kill_grace_s": "kill_grace",
        "checkpoint_grace_s": "checkpoint_grace",
        "gpu_memory_mib": "gpu_memory",
        "time_limit_s": "time_limit",
    }

    def add_service_errors(self, errors: dict[str, list[str]]) -> None:
        for field, messages in errors.items():
            name = self.FIELD_MAP.get(field, field)
            for message in messages:
                self.add_error(name if name in self.fields else None, message)
