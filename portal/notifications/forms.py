"""The preferences form: which events, e-mail on/off, a webhook and its secret."""

from __future__ import annotations

from typing import Any, ClassVar

from django import forms

from portal.notifications.models import CHOOSABLE, Kind, Preference

MIN_SECRET = 16


class PreferenceForm(forms.ModelForm[Preference]):
    kinds = forms.MultipleChoiceField(
        label="Tell me when",
        choices=[(k, Kind(k).label) for k in CHOOSABLE],
        widget=forms.CheckboxSelectMultiple,
        required=False,
    )
    webhook_url = forms.URLField(
        label="Webhook URL",
        required=False,
        assume_scheme="https",
        help_text="A JSON POST to this address for each event (http or https).",
    )
    webhook_secret = forms.CharField(
        label="Webhook secret",
        required=False,
        max_length=200,
        widget=forms.PasswordInput(render_value=False),
        help_text=(
            f"At least {MIN_SECRET} characters, shared with your receiver, which "
            "checks the X-Gpulab-Signature header with it. Leave empty to keep "
            "the current one."
        ),
    )

    class Meta:
        model = Preference
        fields = ("kinds", "email_enabled", "webhook_url", "webhook_secret")
        labels: ClassVar = {"email_enabled": "Send e-mail"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.had_secret = bool(self.instance.webhook_secret)

    def clean_webhook_url(self) -> str:
        url: str = self.cleaned_data.get("webhook_url", "")
        if url and not url.lower().startswith(("http://", "https://")):
            raise forms.ValidationError("Use an http:// or https:// address.")
        return url

    def clean_webhook_secret(self) -> str:
        secret: str = self.cleaned_data.get("webhook_secret", "")
        if not secret:
            return str(self.instance.webhook_secret)  # unchanged
        if len(secret) < MIN_SECRET:
            raise forms.ValidationError(
                f"The secret must be at least {MIN_SECRET} characters long."
            )
        return secret

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if data.get("webhook_url") and not data.get("webhook_secret"):
            self.add_error(
                "webhook_secret",
                "A webhook needs a secret, so your receiver can tell that a "
                "request came from gpulab.",
            )
        if not data.get("webhook_url"):
            data["webhook_secret"] = ""  # no webhook, no secret kept
        return data
