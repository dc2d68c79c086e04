# The adopter's project (.ci/adopter) is copied into a generated Django project and run there,
# with its own settings and pytest: nothing here is a test of this repository's suite.
collect_ignore_glob = ["*"]
