"""The package store: pnpm's files shared between a project's tasks, safely.

A task's ``node_modules`` files become hard links to blobs no task can write, made on the host
after each command; a new task on a lockfile already installed gets its packages placed before
its first command. The rooms:

- :mod:`.blobs`: the content-addressed blob store, its lock, and its prune (``fusion-oci gc``);
- :mod:`.linking`: the pass that walks a worktree's ``node_modules/.pnpm`` and links its files;
- :mod:`.files`: reading and writing files relative to a directory fd, following no symlink;
- :mod:`.pnpm_layout`: what pnpm's layout says of a file (bin targets, shims, packages);
- :mod:`.tree`: a lockfile's tree, recorded by a pass and placed for the next task, and the
  per-task :class:`StoreLinker` the sandbox drives;
- :mod:`.namespace`: an unprivileged caller's store user namespace (the blobs' owner there).

What the rest of the package uses is named here.
"""

from fusion_oci.store.tree import StoreLinker, prune_stores, task_linker

__all__ = ["StoreLinker", "prune_stores", "task_linker"]
