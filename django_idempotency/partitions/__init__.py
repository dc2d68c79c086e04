"""Partitioned tables by UTC day: ``tables`` says which, ``catalog`` lists what exists,
``plan`` decides, ``apply`` runs the DDL, ``maintain`` does a whole run."""
