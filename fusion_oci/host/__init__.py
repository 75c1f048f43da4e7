"""The executor's host: the processes we start there (:mod:`.process`, the one module that
spawns), its scratch and cache folders (:mod:`.scratch`, :mod:`.cachedir`), and the hardening
of the process that holds a task's secrets (:mod:`.hardening`)."""
