"""The preferences form: which events, e-mail on/off, a webhook and its secret.

The URL must not lead into the portal's own network (``Preference.clean``:
``targets.check``, the error names the address and why); the secret is stored encrypted and never shown
(an empty field keeps the one stored, unless it can no longer be read: then the
form asks for it again)."""

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
        fields = ("kinds", "email_enabled", "webhook_url")
        labels: ClassVar = {"email_enabled": "Send e-mail"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.secret_state = self.instance.secret_state

    def clean_webhook_url(self) -> str:
        url: str = self.cleaned_data.get("webhook_url", "")
        if not url:
            return url
        if not url.lower().startswith(("http://", "https://")):
            raise forms.ValidationError("Use an http:// or https:// address.")
        return url  # where it leads is checked by ``Preference.clean``

    def clean_webhook_secret(self) -> str:
        secret: str = self.cleaned_data.get("webhook_secret", "")
        if secret and len(secret) < MIN_SECRET:
            raise forms.ValidationError(
                f"The secret must be at least {MIN_SECRET} characters long."
            )
        return secret

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if not data.get("webhook_url") or data.get("webhook_secret"):
            return data
        if self.secret_state == "unreadable":
            self.add_error(
                "webhook_secret",
                "Your saved secret can no longer be read (the portal's encryption "
                "key changed): enter it again.",
            )
        elif self.secret_state == "none":
            self.add_error(
                "webhook_secret",
                "A webhook needs a secret, so your receiver can tell that a "
                "request came from gpulab.",
            )
        return data

    def save(self, commit: bool = True) -> Preference:  # noqa: FBT001, FBT002
        pref = super().save(commit=False)
        if not pref.webhook_url:
            pref.set_webhook_secret("")  # no webhook, no secret kept
        elif self.cleaned_data.get("webhook_secret"):
            pref.set_webhook_secret(self.cleaned_data["webhook_secret"])
        if commit:
            pref.save()
        return pref
