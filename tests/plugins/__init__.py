"""The suite's pytest plugins, which the root ``conftest.py`` registers: the shared fixtures, by what they give
(``model_fixtures``, ``server_fixtures``), and the hooks that mark, order and group the tests (``scheduling``)."""
