from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction
from rest_framework.authtoken.models import Token

# DEMO ONLY: fixed, public tokens so the README's curl lines work as printed. Never seed
# these into a database that anything real can reach.
DEMO_TOKENS = {"alice": "a" * 40, "bob": "b" * 40}
# DEMO ONLY, for the same reason: a superuser with a fixed, public password, so the admin
# the demo prints can be opened as printed.
DEMO_ADMIN = ("admin", "demo-admin")


class Command(BaseCommand):
    help = (
        "Create the demo users alice and bob with their fixed DEMO-ONLY API tokens, and the "
        "DEMO-ONLY superuser admin (password demo-admin)."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        User = get_user_model()
        with transaction.atomic():
            for username, key in DEMO_TOKENS.items():
                user, created = User.objects.get_or_create(username=username)
                if created:
                    user.set_unusable_password()
                    user.save()
                # A user has one token: replace any other so re-running restores the demo one.
                Token.objects.filter(user=user).exclude(key=key).delete()
                Token.objects.update_or_create(key=key, defaults={"user": user})
                self.stdout.write(f"{username}: Authorization: Token {key}")
            username, password = DEMO_ADMIN
            admin, _ = User.objects.get_or_create(username=username)
            admin.is_staff = admin.is_superuser = admin.is_active = True
            # Set on every run, so re-running restores the documented password.
            admin.set_password(password)
            admin.save()
            self.stdout.write(f"{username}: admin password {password}")
        self.stdout.write(
            self.style.WARNING("These tokens and this password are public: demo use only.")
        )
