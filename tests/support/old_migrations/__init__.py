"""The 18 migrations that built the schema before 0.1.0, frozen as they were: the squashed
``django_idempotency/migrations/0001_initial.py`` must make what they made
(``tests/storage/test_squashed_migration.py`` runs both). Never run by a project."""
