"""A DRF DefaultRouter (format suffixes included) serving one idempotent viewset open to
anonymous clients: the URL checks' view of a viewset (``tests/operators/test_checks.py``)."""

from __future__ import annotations

from rest_framework.permissions import AllowAny
from rest_framework.routers import DefaultRouter

from tests.support.views import GroupViewSet


class OpenGroupViewSet(GroupViewSet):
    permission_classes = [AllowAny]
    idempotency_allow_anonymous = False


router = DefaultRouter()
router.register("groups", OpenGroupViewSet)
urlpatterns = router.urls
