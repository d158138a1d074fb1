"""The console's people: lab groups with their memberships, users with their
Unix account, primary group and lab groups, and their portal profiles."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import admin
from django.contrib.auth.admin import UserAdmin
from django.contrib.auth.models import User
from django.db.models import Count, Prefetch

from scheduler.models import Group, Membership, Profile

if TYPE_CHECKING:
    from django.db.models import QuerySet
    from django.http import HttpRequest


class MembershipInline(admin.TabularInline[Membership, Group]):
    model = Membership
    extra = 1
    autocomplete_fields = ("user",)
    fields = ("user", "shares", "is_leader", "joined_at")


@admin.register(Group)
class GroupAdmin(admin.ModelAdmin[Group]):
    """Lab groups with their memberships inline (shares, leader flag). The list
    names each group's members (the first ``SHOWN_MEMBERS`` by username, then
    how many more) and leaders, with one query each for the whole page.

    The members column is ``member_names``, not ``members``: a list column named
    after the model's many-to-many field is rendered from the field (the
    manager's text, "auth.User.None"), whatever method the admin defines."""

    SHOWN_MEMBERS = 10

    list_display = ("name", "description", "shares", "member_names", "leaders")
    search_fields = ("name",)
    inlines = (MembershipInline,)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Group]:
        leaders = Membership.objects.filter(is_leader=True).select_related("user")
        first = Membership.objects.select_related("user").order_by("user__username")
        return (
            super()
            .get_queryset(request)
            .annotate(member_count=Count("membership"))
            .prefetch_related(
                Prefetch("membership_set", queryset=leaders, to_attr="leader_rows"),
                Prefetch(
                    "membership_set",
                    queryset=first[: self.SHOWN_MEMBERS],
                    to_attr="first_members",
                ),
            )
        )

    @admin.display(description="members", ordering="member_count")
    def member_names(self, obj: Group) -> str:
        rows = getattr(obj, "first_members", [])
        names = ", ".join(m.user.get_username() for m in rows)
        more = int(getattr(obj, "member_count", 0)) - len(rows)
        if more > 0:
            names += f" and {more} more"
        return names or "\u2013"

    @admin.display(description="leaders")
    def leaders(self, obj: Group) -> str:
        rows = getattr(obj, "leader_rows", [])
        return ", ".join(m.user.get_username() for m in rows) or "\u2013"


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin[Membership]):
    list_display = ("user", "group", "shares", "is_leader", "joined_at")
    list_filter = ("group", "is_leader")
    list_select_related = ("user", "group")
    search_fields = ("user__username", "group__name")
    autocomplete_fields = ("user",)


class ProfileInline(admin.StackedInline[Profile, User]):
    model = Profile
    can_delete = False
    verbose_name_plural = "gpulab profile"
    # Set by sign-in from the directory (portal.directory), not by hand.
    readonly_fields = ("directory", "directory_checked_at", "directory_disabled")


class MembershipOfUserInline(admin.TabularInline[Membership, User]):
    model = Membership
    extra = 0
    fields = ("group", "shares", "is_leader", "joined_at")
    verbose_name_plural = "lab groups"


class GpulabUserAdmin(UserAdmin[User]):
    """Django's user admin plus the Unix account, primary group and lab groups of
    the user."""

    inlines = (ProfileInline, MembershipOfUserInline)
    list_display = (
        "username",
        "email",
        "first_name",
        "last_name",
        "is_staff",
        "primary_group",
    )
    list_filter = (
        "is_staff",
        "is_superuser",
        "is_active",
        "groups",
        "gpulab__primary_group",
    )
    list_select_related = ("gpulab__primary_group",)

    @admin.display(description="primary group", ordering="gpulab__primary_group")
    def primary_group(self, obj: User) -> str:
        try:
            profile = obj.gpulab
        except Profile.DoesNotExist:
            return "\u2013"
        group = profile.primary_group
        return group.name if group is not None else "\u2013"


admin.site.unregister(User)
admin.site.register(User, GpulabUserAdmin)


@admin.register(Profile)
class ProfileAdmin(admin.ModelAdmin[Profile]):
    list_display = ("user", "unix_account", "primary_group")
    list_select_related = ("user", "primary_group")
    search_fields = ("user__username", "unix_account")
