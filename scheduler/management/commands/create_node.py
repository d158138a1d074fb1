"""``manage.py create_node NAME``: register a GPU node and give out its agent token."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from scheduler import services
from scheduler.models import Node


def _write_token(path: Path, token: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    tmp.replace(path)


class Command(BaseCommand):
    help = (
        "Register a GPU node and print its agent token once (or write it to "
        "--token-file, mode 600). Use --rotate to replace the token of a node."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("--token-file", type=Path)
        parser.add_argument(
            "--if-missing",
            action="store_true",
            help="do nothing if the node and its token file exist; if the file is "
            "missing, rotate the token and write it",
        )
        parser.add_argument("--rotate", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        name: str = options["name"]
        token_file: Path | None = options["token_file"]
        node = Node.objects.filter(name=name).first()
        if node is not None:
            if options["if_missing"] and token_file and token_file.exists():
                return
            if not (options["rotate"] or options["if_missing"]):
                raise CommandError(
                    f"node {name!r} exists; use --rotate to give it a new token"
                )
            token = services.rotate_node_token(node.pk)
            action = "rotated the token of"
        else:
            try:
                node, token = services.create_node(name)
            except ValidationError as exc:
                raise CommandError("; ".join(exc.messages)) from None
            action = "registered"
        if token_file:
            _write_token(token_file, token)
            self.stdout.write(f"{action} node {name}; token written to {token_file}")
        else:
            self.stdout.write(f"{action} node {name}. Its agent token (shown once):")
            self.stdout.write(token)
