"""Forms of the web UI. Validation rules live in ``scheduler.services``; the form
parses text into values and shows the service's field errors next to the fields."""

from __future__ import annotations

import re
from typing import Any, ClassVar, cast

from django import forms
from django.conf import settings

from scheduler import classes, services

_DURATION_RE = re.compile(
    r"^(?:(?P<d>\d+)d)?\s*(?:(?P<h>\d+)h)?\s*(?:(?P<m>\d+)m)?\s*(?:(?P<s>\d+)s)?$"
)
_MEMORY_RE = re.compile(r"^(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>[MG]i?B?|[MG])?$", re.I)


def parse_duration(text: str) -> int | None:
    """'4h', '1d12h', '90m', '2h30m', '3600s', 'HH:MM:SS' or bare minutes -> seconds."""
    text = text.strip().lower()
    if not text:
        return None
    if text.isdigit():
        return int(text) * 60
    if re.fullmatch(r"\d+:\d{1,2}:\d{1,2}", text):
        h, m, s = (int(p) for p in text.split(":"))
        return h * 3600 + m * 60 + s
    match = _DURATION_RE.match(text)
    if not match or not any(match.groupdict().values()):
        raise forms.ValidationError(
            "Write a duration like 4h, 90m, 1d12h or 02:30:00.", code="invalid"
        )
    parts = {k: int(v or 0) for k, v in match.groupdict().items()}
    return parts["d"] * 86400 + parts["h"] * 3600 + parts["m"] * 60 + parts["s"]


def format_duration(seconds: int) -> str:
    """The exact inverse of ``parse_duration``: 5400 -> '1h30m', 90061 -> '1d1h1m1s'."""
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, seconds = divmod(seconds, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts) or "0s"


def parse_memory_mib(text: str) -> int | None:
    """'12G', '12GB', '16GiB', '512M', '2048' (MiB) -> MiB."""
    text = text.strip()
    if not text:
        return None
    match = _MEMORY_RE.match(text)
    if not match:
        raise forms.ValidationError(
            "Write an amount like 12G, 16GiB or 2048M.", code="invalid"
        )
    number = float(match.group("n"))
    unit = (match.group("unit") or "M").upper()
    mib = number * 1024 if unit.startswith("G") else number
    return max(1, round(mib))


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
            ("requeue", "send this job back to the queue"),
            ("keep", "keep running"),
        ],
        initial="requeue",
        required=False,  # absent: requeue
        help_text="When a job measured over its cap shares a GPU with this one, "
        "and this one joined later.",
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
    on_node_loss = forms.ChoiceField(
        label="If its node is lost",
        choices=[("requeue", "requeue the job"), ("fail", "fail the job")],
        initial="requeue",
        required=False,  # absent: requeue
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
        cast("forms.ChoiceField", self.fields["group"]).choices = [("", "default")] + [
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
        if text.isdigit():
            return int(text)  # plain seconds here, unlike time limits
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
        )

    # Service field names -> form field names.
    FIELD_MAP: ClassVar[dict[str, str]] = {
        "kill_grace_s": "kill_grace",
        "gpu_memory_mib": "gpu_memory",
        "time_limit_s": "time_limit",
    }

    def add_service_errors(self, errors: dict[str, list[str]]) -> None:
        for field, messages in errors.items():
            name = self.FIELD_MAP.get(field, field)
            for message in messages:
                self.add_error(name if name in self.fields else None, message)
