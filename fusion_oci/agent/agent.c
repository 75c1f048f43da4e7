/* fusion-oci-agent: the resident exec agent of one sandbox (see PROTOCOL.md next to this file).
 *
 *   fusion-oci-agent --fd N [--parent PID] [--dumpable] [--scope-runs]   native, landlock:
 *                                            N is our end of a socketpair
 *   fusion-oci-agent --connect PATH          a container's init: connect once to PATH
 *   fusion-oci-agent --exec-status FD -- ARGV one command, its wait status written to FD
 *   fusion-oci-agent --exec-status-file PATH -- ARGV   the same, into a file it creates
 *   fusion-oci-agent --egress SOCK --exec-status-file PATH -- ARGV   with the egress forwarder
 *                                            beside the command, for its life (oci)
 *
 * One connection, framed messages. Per `spawn` the agent forks a keeper; the keeper makes
 * itself a child subreaper, forks the command in its own session and reports how it ended.
 * On `kill` (or when the agent goes away) the keeper ends the whole tree: the command's process
 * group and every descendant, which all re-parent to the keeper. When the connection closes the
 * agent ends every run's tree and exits. Nothing here trusts the command: it never sees the
 * connection (CLOEXEC everywhere, every fd above 2 closed at exec) and we are not dumpable
 * (but with --dumpable: landlock, see there).
 *
 * Why one file of ~1,000 lines: it is one static binary built by one `cc` call (hatch_build.py)
 * on every install, with no build system; its parts (framing, the spawn parser, the keeper, the
 * agent loop) share the global connection state and are read top to bottom in that order.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PROTOCOL_VERSION "1"
#define MAX_FRAME (64u << 20)
#define SHUTDOWN_GRACE_MS 1000
#define LEFTOVER_GRACE_MS 200
#define KILL_LOOP_MS 10000

/* ---------------------------------------------------------------- small helpers */

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("fusion-oci-agent: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(125);
}

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {
    }
}

static int write_all(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == ENOTSOCK)
            w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static void *xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (!q)
        die("out of memory");
    return q;
}

/* ---------------------------------------------------------------- frames to the host */

struct out {
    char buf[2048];
    size_t len;
    size_t start; /* where the frame being built begins */
};

static void out_begin_at(struct out *o, size_t at, char type) {
    o->start = at;
    o->len = at + 5;
    o->buf[at + 4] = type;
}

static void out_begin(struct out *o, char type) {
    out_begin_at(o, 0, type);
}

static void out_field(struct out *o, const char *key, const char *fmt, ...) {
    va_list ap;
    size_t room = sizeof o->buf / 2 - (o->len - o->start); /* two frames always fit */
    int n = snprintf(o->buf + o->len, room, "%s=", key);
    if (n < 0 || (size_t)n >= room)
        return;
    o->len += (size_t)n;
    room -= (size_t)n;
    va_start(ap, fmt);
    n = vsnprintf(o->buf + o->len, room, fmt, ap);
    va_end(ap);
    if (n < 0)
        n = 0;
    if ((size_t)n >= room)
        n = (int)room - 1;
    o->len += (size_t)n + 1; /* keep the NUL */
}

static int conn = -1;

/* Write the length of the frame being built. */
static void out_seal(struct out *o) {
    uint32_t n = (uint32_t)(o->len - o->start - 4);
    char *h = o->buf + o->start;
    h[0] = (char)(n >> 24);
    h[1] = (char)(n >> 16);
    h[2] = (char)(n >> 8);
    h[3] = (char)n;
}

/* Send every frame in the buffer: one send(), so frames from the agent and its keepers
 * never interleave (small writes to a unix stream socket go as one skb). */
static int out_send(struct out *o) {
    out_seal(o);
    return write_all(conn, o->buf, o->len);
}

/* ---------------------------------------------------------------- the process tree */

/* Every descendant of `root` (a snapshot from /proc). Returns the count; *out is malloc'd. */
static size_t descendants(pid_t root, pid_t **out) {
    pid_t *pids = NULL, *ppids = NULL;
    size_t n = 0, cap = 0;
    DIR *d = opendir("/proc");
    if (d) {
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            if (e->d_name[0] < '0' || e->d_name[0] > '9')
                continue;
            char path[300], stat[512];
            snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            if (fd < 0)
                continue;
            ssize_t r = read(fd, stat, sizeof stat - 1);
            close(fd);
            if (r <= 0)
                continue;
            stat[r] = 0;
            char *paren = strrchr(stat, ')'); /* comm may hold spaces and parens */
            if (!paren)
                continue;
            char state;
            int ppid;
            if (sscanf(paren + 1, " %c %d", &state, &ppid) != 2)
                continue;
            if (n == cap) {
                cap = cap ? cap * 2 : 256;
                pids = xrealloc(pids, cap * sizeof *pids);
                ppids = xrealloc(ppids, cap * sizeof *ppids);
            }
            pids[n] = (pid_t)atoi(e->d_name);
            ppids[n] = (pid_t)ppid;
            n++;
        }
        closedir(d);
    }
    pid_t *found = xrealloc(NULL, (n + 1) * sizeof *found);
    size_t nfound = 0, head = 0;
    pid_t cur = root;
    for (;;) {
        for (size_t i = 0; i < n; i++)
            if (ppids[i] == cur && pids[i] != root) {
                found[nfound++] = pids[i];
                ppids[i] = -1; /* never twice */
            }
        if (head >= nfound)
            break;
        cur = found[head++];
    }
    free(pids);
    free(ppids);
    *out = found;
    return nfound;
}

/* Signal every descendant of ours (and the process group `pgid` when > 0). Returns how many
 * processes were there to signal. */
static size_t signal_tree(int sig, pid_t pgid) {
    pid_t *pids;
    size_t n = descendants(getpid(), &pids);
    if (pgid > 0 && kill(-pgid, sig) == 0 && n == 0)
        n = 1;
    for (size_t i = 0; i < n && pids; i++)
        if (pids[i] > 0)
            kill(pids[i], sig);
    free(pids);
    return n;
}

static int has_children(void) {
    siginfo_t info;
    memset(&info, 0, sizeof info);
    return waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) == 0;
}

/* ---------------------------------------------------------------- spawn requests */

struct rlim {
    int resource;
    rlim_t soft, hard;
};

struct spawn {
    char *id, *cwd;
    char **argv, **env;
    size_t argc, envc;
    struct rlim *rl;
    size_t nrl;
    int umask; /* -1: keep */
    long uid, gid; /* -1: keep */
    gid_t *groups;
    size_t ngroups;
    int set_groups;
};

static const struct {
    const char *name;
    int resource;
} RLIMITS[] = {
    {"RLIMIT_AS", RLIMIT_AS},           {"RLIMIT_CORE", RLIMIT_CORE},
    {"RLIMIT_CPU", RLIMIT_CPU},         {"RLIMIT_DATA", RLIMIT_DATA},
    {"RLIMIT_FSIZE", RLIMIT_FSIZE},     {"RLIMIT_LOCKS", RLIMIT_LOCKS},
    {"RLIMIT_MEMLOCK", RLIMIT_MEMLOCK}, {"RLIMIT_MSGQUEUE", RLIMIT_MSGQUEUE},
    {"RLIMIT_NICE", RLIMIT_NICE},       {"RLIMIT_NOFILE", RLIMIT_NOFILE},
    {"RLIMIT_NPROC", RLIMIT_NPROC},     {"RLIMIT_RSS", RLIMIT_RSS},
    {"RLIMIT_RTPRIO", RLIMIT_RTPRIO},   {"RLIMIT_RTTIME", RLIMIT_RTTIME},
    {"RLIMIT_SIGPENDING", RLIMIT_SIGPENDING}, {"RLIMIT_STACK", RLIMIT_STACK},
};

static int parse_long(const char *s, long *v, int base) {
    char *end;
    errno = 0;
    *v = strtol(s, &end, base);
    return errno == 0 && end != s && *end == 0 ? 0 : -1;
}

static int parse_rlim_value(const char *s, rlim_t *v) {
    long x;
    if (parse_long(s, &x, 10) < 0)
        return -1;
    *v = x < 0 ? RLIM_INFINITY : (rlim_t)x;
    return 0;
}

/* Parse `body` (NUL-terminated key=value fields) into *sp. The strings point into body.
 * Returns NULL or what is wrong. */
static const char *parse_spawn(char *body, size_t len, struct spawn *sp) {
    memset(sp, 0, sizeof *sp);
    sp->umask = -1;
    sp->uid = sp->gid = -1;
    if (len == 0 || body[len - 1] != 0)
        return "fields must end with NUL";
    for (char *f = body, *next; f < body + len; f = next) {
        next = f + strlen(f) + 1; /* before the '=' becomes a NUL */
        char *eq = strchr(f, '=');
        if (!eq)
            return "field without '='";
        *eq = 0;
        char *v = eq + 1;
        long x;
        if (!strcmp(f, "id")) {
            sp->id = v;
        } else if (!strcmp(f, "cwd")) {
            sp->cwd = v;
        } else if (!strcmp(f, "argv")) {
            sp->argv = xrealloc(sp->argv, (sp->argc + 2) * sizeof *sp->argv);
            sp->argv[sp->argc++] = v;
            sp->argv[sp->argc] = NULL;
        } else if (!strcmp(f, "env")) {
            sp->env = xrealloc(sp->env, (sp->envc + 2) * sizeof *sp->env);
            sp->env[sp->envc++] = v;
            sp->env[sp->envc] = NULL;
        } else if (!strcmp(f, "umask")) {
            if (parse_long(v, &x, 8) < 0 || x < 0 || x > 0777)
                return "bad umask";
            sp->umask = (int)x;
        } else if (!strcmp(f, "uid") || !strcmp(f, "gid")) {
            if (parse_long(v, &x, 10) < 0 || x < 0)
                return "bad uid/gid";
            *(f[0] == 'u' ? &sp->uid : &sp->gid) = x;
        } else if (!strcmp(f, "groups")) {
            sp->set_groups = 1;
            for (char *g = v; *g;) {
                char *comma = strchr(g, ',');
                if (comma)
                    *comma = 0;
                if (parse_long(g, &x, 10) < 0 || x < 0)
                    return "bad groups";
                sp->groups = xrealloc(sp->groups, (sp->ngroups + 1) * sizeof *sp->groups);
                sp->groups[sp->ngroups++] = (gid_t)x;
                if (!comma)
                    break;
                g = comma + 1;
            }
        } else if (!strcmp(f, "rlimit")) {
            char *c1 = strchr(v, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
            if (!c2)
                return "rlimit is NAME:SOFT:HARD";
            *c1 = *c2 = 0;
            size_t i;
            for (i = 0; i < sizeof RLIMITS / sizeof RLIMITS[0]; i++)
                if (!strcmp(RLIMITS[i].name, v))
                    break;
            if (i == sizeof RLIMITS / sizeof RLIMITS[0])
                return "unknown rlimit";
            sp->rl = xrealloc(sp->rl, (sp->nrl + 1) * sizeof *sp->rl);
            struct rlim *r = &sp->rl[sp->nrl++];
            r->resource = RLIMITS[i].resource;
            if (parse_rlim_value(c1 + 1, &r->soft) < 0 || parse_rlim_value(c2 + 1, &r->hard) < 0)
                return "bad rlimit value";
        } else {
            return "unknown field";
        }
    }
    if (!sp->id)
        return "no id";
    if (sp->argc == 0)
        return "no argv";
    if (!sp->env) {
        sp->env = xrealloc(NULL, sizeof *sp->env);
        sp->env[0] = NULL;
    }
    return NULL;
}

static void free_spawn(struct spawn *sp) {
    free(sp->argv);
    free(sp->env);
    free(sp->rl);
    free(sp->groups);
}

/* ---------------------------------------------------------------- the command (grandchild) */

struct failure {
    int err;
    char what[60];
};

static void fail_exec(int errfd, const char *what) {
    struct failure f;
    f.err = errno;
    snprintf(f.what, sizeof f.what, "%s", what);
    if (write(errfd, &f, sizeof f) < 0) {
        /* nothing left to tell it with */
    }
    _exit(127);
}

static const char *env_get(char **env, const char *key) {
    size_t k = strlen(key);
    for (; *env; env++)
        if (!strncmp(*env, key, k) && (*env)[k] == '=')
            return *env + k + 1;
    return NULL;
}

/* execvp with the PATH of the command's environment (not ours). */
static void exec_search(char **argv, char **env) {
    const char *file = argv[0];
    if (strchr(file, '/')) {
        execve(file, argv, env);
        return;
    }
    const char *path = env_get(env, "PATH");
    if (!path)
        path = "/usr/local/bin:/usr/bin:/bin";
    int seen_eacces = 0;
    char buf[PATH_MAX];
    for (const char *p = path;; p++) {
        const char *colon = strchr(p, ':');
        size_t n = colon ? (size_t)(colon - p) : strlen(p);
        if (n == 0)
            snprintf(buf, sizeof buf, "%s", file);
        else
            snprintf(buf, sizeof buf, "%.*s/%s", (int)n, p, file);
        execve(buf, argv, env);
        if (errno == EACCES)
            seen_eacces = 1;
        else if (errno != ENOENT && errno != ENOTDIR && errno != ENAMETOOLONG)
            return;
        if (!colon)
            break;
        p = colon;
    }
    errno = seen_eacces ? EACCES : ENOENT;
}

/* --scope-runs (landlock, ABI 6+): each command in a Landlock domain of its own, nested in
 * ours, that scopes signals and abstract unix sockets. A nested domain may not signal its
 * parent's: no command can stop or kill the agent or a keeper (ours can still signal it). */
static int scope_runs;

static void scope_run(int errfd) {
    struct {
        uint64_t handled_access_fs, handled_access_net, scoped;
    } attr = {0, 0, 1 /* ABSTRACT_UNIX_SOCKET */ | 2 /* SIGNAL */};
    int ruleset = (int)syscall(SYS_landlock_create_ruleset, &attr, sizeof attr, 0);
    if (ruleset < 0)
        fail_exec(errfd, "landlock_create_ruleset");
    if (syscall(SYS_landlock_restrict_self, ruleset, 0) < 0)
        fail_exec(errfd, "landlock_restrict_self");
    close(ruleset);
}

static void child_exec(struct spawn *sp, int fds[3], int errfd) {
    sigset_t none;
    sigemptyset(&none);
    /* Dispositions were reset once at the agent's start; only the mask is ours to undo. */
    sigprocmask(SIG_SETMASK, &none, NULL);
    if (setsid() < 0)
        fail_exec(errfd, "setsid");
    int high[3];
    for (int i = 0; i < 3; i++)
        if ((high[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 10)) < 0)
            fail_exec(errfd, "dup");
    for (int i = 0; i < 3; i++)
        if (dup2(high[i], i) < 0)
            fail_exec(errfd, "dup2");
    /* Whatever we inherited (a container runtime's fds, ours) does not reach the command. */
    if (syscall(SYS_close_range, 3, ~0U, 4 /* CLOSE_RANGE_CLOEXEC */) < 0) {
        for (int fd = 3; fd < 1024; fd++)
            if (fd != errfd)
                fcntl(fd, F_SETFD, FD_CLOEXEC);
    }
    if (sp->umask >= 0)
        umask((mode_t)sp->umask);
    for (size_t i = 0; i < sp->nrl; i++) {
        struct rlimit r = {sp->rl[i].soft, sp->rl[i].hard};
        if (setrlimit(sp->rl[i].resource, &r) < 0) {
            char what[40];
            snprintf(what, sizeof what, "setrlimit %d", sp->rl[i].resource);
            fail_exec(errfd, what);
        }
    }
    if (sp->set_groups && setgroups(sp->ngroups, sp->groups) < 0)
        fail_exec(errfd, "setgroups");
    if (sp->gid >= 0 && setresgid((gid_t)sp->gid, (gid_t)sp->gid, (gid_t)sp->gid) < 0)
        fail_exec(errfd, "setgid");
    if (sp->uid >= 0 && setresuid((uid_t)sp->uid, (uid_t)sp->uid, (uid_t)sp->uid) < 0)
        fail_exec(errfd, "setuid");
    if (sp->cwd && chdir(sp->cwd) < 0)
        fail_exec(errfd, "chdir");
    if (scope_runs)
        scope_run(errfd);
    exec_search(sp->argv, sp->env);
    fail_exec(errfd, "execve");
}

/* ---------------------------------------------------------------- the keeper (child) */

/* agent <-> keeper: fixed binary records over a SOCK_SEQPACKET pair. The keeper writes its
 * `T`, `F` and `X` frames to the host itself (one send() each, a single skb: frames never
 * interleave), so a command's end costs no hop through the agent; it then tells the agent
 * `D` (done, reported), so that a keeper that dies silently can be reported for. */
struct kmsg {
    char type; /* keeper->agent: 'D' reported, 'L' its connect listener (+ fd); agent->keeper:
                * 'K' kill */
    int32_t sig, tree, grace_ms;
};

static void send_failed(const char *id, int err, const char *what);

static int make_sigfd(void) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    sigaddset(&set, SIGPIPE);
    sigprocmask(SIG_BLOCK, &set, NULL);
    sigdelset(&set, SIGPIPE);
    int fd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
    if (fd < 0)
        die("signalfd: %s", strerror(errno));
    return fd;
}

static pid_t cmd_pid;
static int cmd_status = -1;

static void keeper_reap(void) {
    int st;
    pid_t p;
    while ((p = waitpid(-1, &st, WNOHANG)) > 0)
        if (p == cmd_pid)
            cmd_status = st;
}

/* sig to the command's group and every descendant; after grace_ms SIGKILL until none left. */
static void end_tree(int sig, int grace_ms) {
    if (signal_tree(sig, cmd_pid)) {
        long long deadline = now_ms() + grace_ms;
        while (now_ms() < deadline) {
            keeper_reap();
            if (!has_children())
                return;
            sleep_ms(10);
        }
    }
    /* A fork bomb cannot outrun this for long. */
    long long deadline = now_ms() + KILL_LOOP_MS;
    while (signal_tree(SIGKILL, cmd_pid) && now_ms() < deadline) {
        keeper_reap();
        sleep_ms(5);
    }
    keeper_reap();
}

static void keeper_done(int chan) {
    struct kmsg m;
    memset(&m, 0, sizeof m);
    m.type = 'D';
    if (send(chan, &m, sizeof m, MSG_NOSIGNAL) < 0) {
        /* the agent is gone: nothing to tell */
    }
}

static int inject_on;
static void inject_install(int chan);

static void keeper_main(struct spawn *sp, int fds[3], int chan) {
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    if (inject_on)
        inject_install(chan); /* before the command exists: it and all it starts are filtered */
    int sigfd = make_sigfd();
    int errpipe[2];
    if (pipe2(errpipe, O_CLOEXEC) < 0) {
        send_failed(sp->id, errno, "pipe");
        keeper_done(chan);
        _exit(0);
    }
    cmd_pid = fork();
    if (cmd_pid == 0) {
        close(chan);
        close(sigfd);
        close(conn);
        close(errpipe[0]);
        child_exec(sp, fds, errpipe[1]);
    }
    int fork_errno = errno;
    close(errpipe[1]);
    for (int i = 0; i < 3; i++)
        close(fds[i]);
    if (cmd_pid < 0) {
        close(errpipe[0]);
        send_failed(sp->id, fork_errno, "fork");
        keeper_done(chan);
        _exit(0);
    }
    /* The exec's outcome is read in the loop, not waited for: the command runs meanwhile,
     * and a short one's `T` and `X` leave together. */
    int errfd = errpipe[0];
    struct failure f;
    int failed = 0, started = 0;
    struct out o;
    while (cmd_status < 0) {
        struct pollfd p[3] = {{chan, POLLIN, 0}, {sigfd, POLLIN, 0}, {errfd, POLLIN, 0}};
        if (poll(p, errfd >= 0 ? 3 : 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            end_tree(SIGKILL, 0);
            break;
        }
        if (errfd >= 0 && p[2].revents) {
            failed = read(errfd, &f, sizeof f) == (ssize_t)sizeof f;
            close(errfd);
            errfd = -1;
            if (!failed) {
                started = 1;
                out_begin(&o, 'T');
                out_field(&o, "id", "%s", sp->id);
                out_field(&o, "pid", "%d", (int)cmd_pid);
                out_send(&o);
            }
        }
        if (p[1].revents) {
            struct signalfd_siginfo si;
            while (read(sigfd, &si, sizeof si) == (ssize_t)sizeof si) {
                if (si.ssi_signo != SIGCHLD)
                    end_tree(SIGTERM, SHUTDOWN_GRACE_MS);
            }
            keeper_reap();
        }
        if (p[0].revents) {
            struct kmsg k;
            ssize_t n = recv(chan, &k, sizeof k, MSG_DONTWAIT);
            if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
                end_tree(SIGTERM, SHUTDOWN_GRACE_MS); /* the agent is gone or closing */
                chan = -1;
                break;
            }
            if (n == (ssize_t)sizeof k && k.type == 'K') {
                if (k.tree)
                    end_tree(k.sig, k.grace_ms);
                else
                    kill(cmd_pid, k.sig);
            }
        }
    }
    keeper_reap();
    if (errfd >= 0) { /* it ended before we looked: a failure was written before its exit */
        failed = read(errfd, &f, sizeof f) == (ssize_t)sizeof f;
        close(errfd);
    }
    if (failed) {
        f.what[sizeof f.what - 1] = 0;
        if (chan >= 0)
            send_failed(sp->id, f.err, f.what);
        keeper_done(chan);
        _exit(0);
    }
    /* The command is done: whatever it left running goes too. */
    if (has_children())
        end_tree(SIGTERM, LEFTOVER_GRACE_MS);
    if (chan >= 0) { /* not when the agent is gone: the host is told it is lost instead */
        size_t at = 0;
        if (!started) { /* `T` and `X` in one send: one wake-up of the host */
            out_begin(&o, 'T');
            out_field(&o, "id", "%s", sp->id);
            out_field(&o, "pid", "%d", (int)cmd_pid);
            out_seal(&o);
            at = o.len;
        }
        out_begin_at(&o, at, 'X');
        out_field(&o, "id", "%s", sp->id);
        /* never reaped: report SIGKILL */
        out_field(&o, "status", "%d", cmd_status < 0 ? SIGKILL : cmd_status);
        out_send(&o);
        keeper_done(chan);
    }
    _exit(0);
}

/* ---------------------------------------------------------------- the egress forwarder */

/* `--egress PATH` (network: filtered): the sandbox's network namespace has only `lo`; we
 * listen on 127.0.0.1:3128 there and splice each connection to a new connection to PATH, the
 * host's egress proxy (a unix socket bound into the sandbox). It runs in the agent's own poll
 * loop: as PID 1 nothing in the sandbox can kill it, and it is bound before the first command
 * runs, so no command can take the port first. It grants nothing a command lacks: it runs
 * under the command's own uid and capabilities, connects only to PATH (which the command can
 * reach itself), and the proxy decides what is allowed. Each connection holds at most one
 * buffer per direction; past FWD_MAX connections new ones wait in the listen backlog. */
#define FWD_PORT 3128
#define FWD_MAX 512
#define FWD_BUF 65536
#define FWD_CONNECT_MS 5000
#define FWD_LISTENERS 65 /* the egress forwarder and up to 64 host services */

/* `--service ADDR=PATH` (policy.hostServices): the same forwarder on another loopback
 * address of the sandbox's own (127.0.0.1:5432, [::1]:6379), to PATH, the relay of that one
 * host service (a unix socket bound into the sandbox). Each listener has its own PATH; a
 * connection goes to its listener's PATH and nowhere else.
 *
 * The relay connects to its grant and hands us that connected socket (SCM_RIGHTS, with one
 * byte): we answer 'K' and move the bytes between the command's connection and it ourselves
 * (splice(2) through a pipe: no copy through user memory, no host process in the data path),
 * keeping the relay's connection open only to report the byte counts at the end (two u64
 * big-endian: to the service, from it) for its audit event, and closing the command's
 * connection when the relay closes it (the task stops). A byte without an fd (a runtime that
 * drops SCM_RIGHTS on a host socket) is answered 'S': the relay then splices for us, as
 * before. The socket we get is connected and never reconnected by us: it reaches its grant
 * and nothing else, and no command can take it (we are not dumpable, not ptraceable).
 *
 * Faster still, and what a new connection normally takes: before hello we open one more
 * connection to each relay, its pool ('P'), over which the relay keeps FWD_POOL fresh,
 * unconnected TCP sockets of the host's network namespace in our hands ('p' + SCM_RIGHTS).
 * A command's connection takes one and we connect it to the grant's address (our --service
 * ADDR:PORT, the grant itself): no host process between accept and connect. On that same
 * connection we tell the relay each socket taken ('O', it sends another) and each
 * connection's end ('D': its counts, or the connect's errno), records of FWD_REC bytes, for
 * its audit event. An empty pool (none yet, the relay's connection bound reached, gVisor)
 * falls back to the dial above ('C'). Holding an unconnected host socket is no more than
 * holding a connected one (either can connect anywhere on the host's loopback), and we
 * connect ours to the grant only. */
#define FWD_PIPE (1024 * 1024)
#define FWD_SLOTS 3 /* pollfds per connection: the command's side, the other, the report */
#define FWD_POOL 8
#define FWD_REC 32 /* type, 3 zero bytes, u32 id, u64 to the service, u64 from it, u32 errno, 0 */
struct listener {
    int fd;      /* the listening socket on the sandbox's loopback; -1: a published port's */
    const char *path;
    int handoff; /* 1: a host service's relay (it hands over the connected socket); 2: a
                  * published port's (its relay hands us each inbound connection) */
    int ctl;     /* the relay's pool connection, or -1 */
    int pool[FWD_POOL];
    unsigned char held[FWD_POOL * FWD_REC]; /* 'H' records not yet sent (fwd_hold) */
    size_t nheld;
    long long held_since;
    int npool;
    unsigned next_id;
    struct sockaddr_storage to; /* the grant's address: where a pool socket is connected */
    socklen_t tolen;
};
static struct listener lis[FWD_LISTENERS];
static size_t nlis;

struct half {
    char *buf; /* what was read from this side, not yet written to the other */
    size_t len, off;
    int eof;  /* this side will send no more */
    int shut; /* the other side was told (shutdown SHUT_WR) */
    int pipe[2]; /* splice(2) mode (both sides sockets of ours): len counts what the pipe
                  * holds, cap its size; -1: through buf */
    size_t cap;
    unsigned long long moved; /* bytes written to the other side */
};

struct pair {
    const char *path;   /* where fd[1] goes: its listener's PATH */
    int fd[2];          /* 0: the command's TCP connection, 1: the proxy's unix socket */
    struct half h[2];   /* h[i]: from fd[i] to fd[1 - i] */
    long long deadline; /* while > 0: fd[1] is still connecting (the proxy's backlog was full) */
    int awaiting;       /* a relay's connection that has not yet handed over its socket */
    int report;         /* the relay's connection once fd[1] is the handed socket; else -1 */
    int pooled;         /* fd[1] came from the pool of listener li, reported as id */
    int connecting;     /* fd[1] (pooled) is still connecting to the grant */
    int err;            /* why fd[1] did not connect (pooled), for the relay's record */
    size_t li;
    unsigned id;
    int dead;
};

static struct pair *pairs;
static size_t npairs;

static void lo_up(void) {
    /* An empty network namespace has `lo` down (bwrap and the engines bring it up, a bare
     * runtime may not). Bringing it up needs CAP_NET_ADMIN over the namespace; without it the
     * bind below says what is wrong. */
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return;
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    if (ioctl(s, SIOCGIFFLAGS, &ifr) == 0 && !(ifr.ifr_flags & IFF_UP)) {
        ifr.ifr_flags |= IFF_UP;
        if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0) {
            /* not ours to change: bind reports it */
        }
    }
    close(s);
}

/* Listen on the sandbox's own loopback, `addr` (an IPv4 or IPv6 literal) port `port` (no
 * SO_REUSEADDR/SO_REUSEPORT: nothing can share the port). */
static int listen_at(const char *addr, int port, struct sockaddr_storage *out, socklen_t *outlen) {
    lo_up();
    int v6 = strchr(addr, ':') != NULL;
    int s = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s < 0)
        die("forwarder: socket: %s", strerror(errno));
    struct sockaddr_storage ss;
    socklen_t len;
    memset(&ss, 0, sizeof ss);
    if (v6) {
        struct sockaddr_in6 *sa = (struct sockaddr_in6 *)&ss;
        int one = 1;
        setsockopt(s, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
        sa->sin6_family = AF_INET6;
        sa->sin6_port = htons((uint16_t)port);
        if (inet_pton(AF_INET6, addr, &sa->sin6_addr) != 1)
            die("forwarder: %s is not an address", addr);
        len = sizeof *sa;
    } else {
        struct sockaddr_in *sa = (struct sockaddr_in *)&ss;
        sa->sin_family = AF_INET;
        sa->sin_port = htons((uint16_t)port);
        if (inet_pton(AF_INET, addr, &sa->sin_addr) != 1)
            die("forwarder: %s is not an address", addr);
        len = sizeof *sa;
    }
    if (bind(s, (struct sockaddr *)&ss, len) < 0 || listen(s, 128) < 0)
        die("forwarder: listen on %s%s%s:%d: %s", v6 ? "[" : "", addr, v6 ? "]" : "", port,
            strerror(errno));
    *out = ss;
    *outlen = len;
    return s;
}

static void add_listener(const char *addr, int port, const char *path, int handoff) {
    if (nlis >= FWD_LISTENERS)
        die("forwarder: more than %d listeners", FWD_LISTENERS);
    struct listener *l = &lis[nlis];
    l->fd = listen_at(addr, port, &l->to, &l->tolen);
    l->path = path;
    l->handoff = handoff;
    l->ctl = -1;
    l->npool = 0;
    l->next_id = 0;
    nlis++;
}

/* `ADDR:PORT=PATH` or `[ADDR6]:PORT=PATH`: a listener on the sandbox's loopback spliced to
 * PATH. The spec is ours (argv): it is split in place. */
static void add_service(char *spec) {
    char *eq = strchr(spec, '=');
    if (!eq || eq[1] != '/')
        die("--service %s: want ADDR:PORT=PATH", spec);
    *eq = 0;
    char *addr = spec, *colon;
    if (*addr == '[') {
        char *close = strchr(addr, ']');
        if (!close || close[1] != ':')
            die("--service: want [ADDR]:PORT=PATH");
        *close = 0;
        addr++;
        colon = close + 1;
    } else {
        colon = strrchr(addr, ':');
        if (!colon)
            die("--service: want ADDR:PORT=PATH");
        *colon = 0;
    }
    char *end;
    long port = strtol(colon + 1, &end, 10);
    if (*end || port <= 0 || port > 65535)
        die("--service: bad port %s", colon + 1);
    add_listener(addr, (int)port, eq + 1, 1);
}

/* `--publish PORT=PATH` (policy.publishPorts): no listener of ours. Before hello we dial
 * PATH, the task's published port on the host, and send 'I'; its relay (which accepts only
 * the sandbox's init) then hands us each connection a host client made to the published port
 * ('a' + SCM_RIGHTS, the accepted socket), which we connect to 127.0.0.1:PORT here, in the
 * sandbox's own network namespace, and splice as a pool connection (records 'O'/'D' on the
 * same connection for its audit event). Nothing of the host's reaches a command: it only
 * accepts a connection on its own loopback; the host socket stays ours. */
static void add_publish(char *spec) {
    char *eq = strchr(spec, '=');
    if (!eq || eq[1] != '/')
        die("--publish %s: want PORT=PATH", spec);
    *eq = 0;
    char *end;
    long port = strtol(spec, &end, 10);
    if (*end || port <= 0 || port > 65535)
        die("--publish: bad port %s", spec);
    if (nlis >= FWD_LISTENERS)
        die("forwarder: more than %d listeners", FWD_LISTENERS);
    struct listener *l = &lis[nlis++];
    memset(l, 0, sizeof *l);
    l->fd = -1;
    l->path = eq + 1;
    l->handoff = 2;
    l->ctl = -1;
    struct sockaddr_in *sa = (struct sockaddr_in *)&l->to;
    sa->sin_family = AF_INET;
    sa->sin_port = htons((uint16_t)port);
    sa->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    l->tolen = sizeof *sa;
}

/* A new connection to the proxy's socket at `path`: its fd (maybe still connecting: *busy),
 * or -1. */
static int unix_dial(const char *path, int nonblock, int *busy) {
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof sa.sun_path) {
        errno = ENAMETOOLONG;
        return -1;
    }
    strcpy(sa.sun_path, path);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | (nonblock ? SOCK_NONBLOCK : 0), 0);
    if (s < 0)
        return -1;
    *busy = 0;
    if (connect(s, (struct sockaddr *)&sa, sizeof sa) < 0) {
        if (errno == EAGAIN && nonblock) {
            *busy = 1; /* the proxy's backlog is full: try again on the next round */
            return s;
        }
        int err = errno;
        close(s);
        errno = err;
        return -1;
    }
    return s;
}

static int fwd_retry_connect(struct pair *c) {
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    strcpy(sa.sun_path, c->path);
    if (connect(c->fd[1], (struct sockaddr *)&sa, sizeof sa) == 0 || errno == EISCONN) {
        c->deadline = 0;
        return 0;
    }
    return errno == EAGAIN && now_ms() < c->deadline ? 0 : -1;
}

static void fwd_pipes(struct pair *c) {
    for (int i = 0; i < 2; i++) {
        if (pipe2(c->h[i].pipe, O_NONBLOCK | O_CLOEXEC) < 0) {
            c->h[i].pipe[0] = c->h[i].pipe[1] = -1; /* through buf: slower, as correct */
            continue;
        }
        /* A larger pipe takes more per call (fewer wake-ups); where the user's pipe budget
         * is spent it stays at the default. */
        int size = fcntl(c->h[i].pipe[1], F_SETPIPE_SZ, FWD_PIPE);
        if (size < 0)
            size = fcntl(c->h[i].pipe[1], F_GETPIPE_SZ);
        c->h[i].cap = size > 0 ? (size_t)size : 65536;
    }
}

/* A record to listener li's relay on its pool connection (lost if the relay does not read:
 * the connection's buffer holds thousands). */
static void fwd_encode(unsigned char r[FWD_REC], char type, unsigned id, unsigned long long up,
                       unsigned long long down, int err) {
    memset(r, 0, FWD_REC);
    r[0] = (unsigned char)type;
    for (int b = 0; b < 4; b++) {
        r[4 + b] = (unsigned char)(id >> (24 - 8 * b));
        r[24 + b] = (unsigned char)((unsigned)err >> (24 - 8 * b));
    }
    for (int b = 0; b < 8; b++) {
        r[8 + b] = (unsigned char)(up >> (56 - 8 * b));
        r[16 + b] = (unsigned char)(down >> (56 - 8 * b));
    }
}

static void fwd_record(size_t li, char type, unsigned id, unsigned long long up,
                       unsigned long long down, int err) {
    if (lis[li].ctl < 0)
        return;
    unsigned char r[FWD_REC];
    fwd_encode(r, type, id, up, down, err);
    if (send(lis[li].ctl, r, sizeof r, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
        /* the relay is gone or not reading: its audit misses this one */
    }
}

/* The 'H' records of listener li, sent at once: the relay reads them, audits each and sends
 * as many fresh sockets in one message, one wake-up for several connections. */
static void fwd_flush_held(size_t li) {
    struct listener *l = &lis[li];
    if (l->nheld && l->ctl >= 0 &&
        send(l->ctl, l->held, l->nheld, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
        /* the relay is gone or not reading: its audit misses these */
    }
    l->nheld = 0;
}

/* An 'H' record, held until half the pool is gone (the relay owes that many sockets), or
 * HELD_MS at most (the main loop's timeout), so that a lone connection is audited at once
 * in human terms and a burst costs the relay one wake-up per half pool. */
#define HELD_MS 20
static void fwd_hold(size_t li, unsigned id) {
    struct listener *l = &lis[li];
    if (l->nheld + FWD_REC > sizeof l->held)
        fwd_flush_held(li);
    fwd_encode(l->held + l->nheld, 'H', id, 0, 0, 0);
    if (!l->nheld)
        l->held_since = now_ms();
    l->nheld += FWD_REC;
    if (l->npool <= FWD_POOL / 2)
        fwd_flush_held(li);
}

/* Whether records are held, and flush those held for HELD_MS. */
static int fwd_held_due(void) {
    int any = 0;
    for (size_t i = 0; i < nlis; i++) {
        if (!lis[i].nheld)
            continue;
        if (now_ms() - lis[i].held_since >= HELD_MS)
            fwd_flush_held(i);
        else
            any = 1;
    }
    return any;
}

static struct pair *fwd_new_pair(int c, int u, const struct listener *l) {
    pairs = xrealloc(pairs, (npairs + 1) * sizeof *pairs);
    struct pair *pr = &pairs[npairs++];
    memset(pr, 0, sizeof *pr);
    pr->path = l->path;
    pr->fd[0] = c;
    pr->fd[1] = u;
    pr->report = -1;
    pr->li = (size_t)(l - lis);
    for (int i = 0; i < 2; i++)
        pr->h[i].pipe[0] = pr->h[i].pipe[1] = -1;
    return pr;
}

static void fwd_accept(struct listener *l) {
    while (npairs < FWD_MAX) {
        int c = accept4(l->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c < 0)
            return; /* EAGAIN, or a connection that went away: nothing to do */
        if (l->handoff == 1 && l->ctl >= 0 && l->npool > 0) {
            /* A socket of the pool, connected by us to the grant's own address. */
            int s = l->pool[--l->npool];
            unsigned id = l->next_id++;
            fwd_record((size_t)(l - lis), 'O', id, 0, 0, 0);
            int r = connect(s, (struct sockaddr *)&l->to, l->tolen);
            if (r < 0 && errno != EINPROGRESS) {
                fwd_record((size_t)(l - lis), 'D', id, 0, 0, errno ? errno : ECONNREFUSED);
                close(s);
                close(c); /* refused: the command sees its connection closed */
                continue;
            }
            if (r < 0) {
                /* A loopback connect is usually done by now: look once, without waiting,
                 * rather than a round of the loop. */
                struct pollfd w = {s, POLLOUT, 0};
                int err = 0;
                socklen_t el = sizeof err;
                if (poll(&w, 1, 0) == 1 && getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &el) == 0) {
                    if (err) {
                        fwd_record((size_t)(l - lis), 'D', id, 0, 0, err);
                        close(s);
                        close(c);
                        continue;
                    }
                    r = 0;
                }
            }
            struct pair *pr = fwd_new_pair(c, s, l);
            pr->pooled = 1;
            pr->id = id;
            pr->connecting = r < 0;
            fwd_pipes(pr);
            continue;
        }
        int busy;
        int u = unix_dial(l->path, 1, &busy);
        if (u < 0) {
            close(c); /* the proxy is gone: the command sees its connection closed */
            continue;
        }
        if (l->handoff && !busy && send(u, "C", 1, MSG_DONTWAIT | MSG_NOSIGNAL) != 1) {
            close(u);
            close(c);
            continue;
        }
        struct pair *pr = fwd_new_pair(c, u, l);
        pr->deadline = busy ? now_ms() + FWD_CONNECT_MS : 0;
        pr->awaiting = l->handoff;
    }
}

static void fwd_close(struct pair *c);

/* A socket connecting to published listener l's 127.0.0.1:PORT for its connection `id`
 * (*pending: the connect goes on), or -1 once its failure is recorded ('D'). */
static int fwd_dial_inside(struct listener *l, unsigned id, int *pending) {
    size_t li = (size_t)(l - lis);
    int s = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s < 0) {
        fwd_record(li, 'D', id, 0, 0, errno);
        return -1;
    }
    int one = 1;
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int r = connect(s, (struct sockaddr *)&l->to, l->tolen);
    if (r < 0 && errno != EINPROGRESS) {
        fwd_record(li, 'D', id, 0, 0, errno ? errno : ECONNREFUSED);
        close(s);
        return -1;
    }
    *pending = r < 0;
    return s;
}

/* A published port's inbound connection `h` (the host client's, handed by its relay):
 * connected here to 127.0.0.1:PORT and spliced like a pool connection. */
static void fwd_inbound(struct listener *l, int h) {
    size_t li = (size_t)(l - lis);
    /* 'O' for every socket handed to us, in order (the relay pairs them with its clients),
     * then 'D' however it ends. */
    unsigned id = l->next_id++;
    fwd_record(li, 'O', id, 0, 0, 0);
    if (npairs >= FWD_MAX || fcntl(h, F_SETFL, O_NONBLOCK) < 0) {
        fwd_record(li, 'D', id, 0, 0, EMFILE);
        close(h); /* the host client sees its connection closed */
        return;
    }
    int pending = 0;
    int s = fwd_dial_inside(l, id, &pending);
    if (s < 0) {
        close(h);
        return;
    }
    struct pair *pr = fwd_new_pair(h, s, l);
    pr->pooled = 1;
    pr->id = id;
    pr->connecting = pending;
    fwd_pipes(pr);
}

/* A published port's inbound connection where no host socket can reach us (gVisor drops
 * SCM_RIGHTS from the host): the relay sends 'c' + a 16-byte token on our 'I' connection,
 * we dial its socket again, send 'A' + that token (only we read it: a command that dials the
 * relay cannot name a client), connect 127.0.0.1:PORT here and move the bytes between the
 * two; the relay moves them on to its client. 'O'/'D' records as for a handed socket. */
#define DIALBACK_TOKEN 16
static void fwd_dialback(struct listener *l, const unsigned char token[DIALBACK_TOKEN]) {
    size_t li = (size_t)(l - lis);
    unsigned id = l->next_id++;
    fwd_record(li, 'O', id, 0, 0, 0);
    if (npairs >= FWD_MAX) {
        fwd_record(li, 'D', id, 0, 0, EMFILE);
        return;
    }
    int busy = 0;
    int u = unix_dial(l->path, 1, &busy);
    if (u < 0 || busy) {
        /* the relay is gone, or its backlog is full: its client is closed */
        fwd_record(li, 'D', id, 0, 0, u < 0 ? errno : EAGAIN);
        if (u >= 0)
            close(u);
        return;
    }
    unsigned char hello[1 + DIALBACK_TOKEN];
    hello[0] = 'A';
    memcpy(hello + 1, token, DIALBACK_TOKEN);
    if (send(u, hello, sizeof hello, MSG_DONTWAIT | MSG_NOSIGNAL) != sizeof hello) {
        fwd_record(li, 'D', id, 0, 0, EPIPE);
        close(u);
        return;
    }
    int pending = 0;
    int s = fwd_dial_inside(l, id, &pending);
    if (s < 0) {
        close(u); /* the relay closes its client */
        return;
    }
    /* Through buffers, not splice: the runtime that needs this (gVisor) is one whose
     * splice between sockets is a copy anyway. */
    struct pair *pr = fwd_new_pair(u, s, l);
    pr->pooled = 1;
    pr->id = id;
    pr->connecting = pending;
}

/* The rest of a 'c' on a published port's connection: its token (sent with the 'c' in one
 * write; waited for a moment should the stream have split it). 0 when read whole. */
static int fwd_token(int ctl, unsigned char token[DIALBACK_TOKEN]) {
    size_t got = 0;
    while (got < DIALBACK_TOKEN) {
        ssize_t n = recv(ctl, token + got, DIALBACK_TOKEN - got, MSG_DONTWAIT);
        if (n > 0) {
            got += (size_t)n;
            continue;
        }
        if (n == 0 || (errno != EAGAIN && errno != EINTR))
            return -1;
        struct pollfd w = {ctl, POLLIN, 0};
        if (poll(&w, 1, 1000) <= 0)
            return -1;
    }
    return 0;
}

/* `len` bytes and the fds riding on them (CLOEXEC; at most FDS_PER_BYTE, the control
 * buffer's room: MSG_CTRUNC in *flags says more were cut). Returns recvmsg's result, errno
 * kept; the *nfds fds are the caller's whatever it returns. A relay's one byte, a keeper's
 * record. */
#define FDS_PER_BYTE 4
static ssize_t recv_with_fds(int sock, void *buf, size_t len, int fds[FDS_PER_BYTE],
                             size_t *nfds, int *flags) {
    union {
        char buf[CMSG_SPACE(sizeof(int) * FDS_PER_BYTE)];
        struct cmsghdr align;
    } cm;
    struct iovec iov = {buf, len};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cm.buf;
    mh.msg_controllen = sizeof cm.buf;
    *nfds = 0;
    *flags = 0;
    ssize_t n = recvmsg(sock, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0)
        return n;
    for (struct cmsghdr *h = CMSG_FIRSTHDR(&mh); h; h = CMSG_NXTHDR(&mh, h)) {
        if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS)
            continue;
        size_t k = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t j = 0; j < k; j++) {
            int fd;
            memcpy(&fd, CMSG_DATA(h) + j * sizeof(int), sizeof fd);
            if (*nfds < FDS_PER_BYTE)
                fds[(*nfds)++] = fd;
            else
                close(fd);
        }
    }
    *flags = mh.msg_flags;
    return n;
}

static ssize_t recv_byte_fds(int sock, char *byte, int fds[FDS_PER_BYTE], size_t *nfds,
                             int *flags) {
    return recv_with_fds(sock, byte, 1, fds, nfds, flags);
}

/* The relay's pool connection: fresh sockets ('p' + one fd each), or its end (the task
 * stops: every connection of this listener's pool is closed). */
static void fwd_ctl(struct listener *l) {
    for (;;) {
        char byte;
        int fds[FDS_PER_BYTE], flags;
        size_t k;
        ssize_t n = recv_byte_fds(l->ctl, &byte, fds, &k, &flags);
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            return;
        for (size_t j = 0; j < k; j++) {
            int type = 0;
            socklen_t tl = sizeof type;
            if (n <= 0) {
                close(fds[j]);
                continue;
            }
            if (l->handoff == 2) {
                if (byte == 'a' && getsockopt(fds[j], SOL_SOCKET, SO_TYPE, &type, &tl) == 0 &&
                    type == SOCK_STREAM)
                    fwd_inbound(l, fds[j]);
                else
                    close(fds[j]);
                continue;
            }
            if (byte == 'p' && l->npool < FWD_POOL &&
                getsockopt(fds[j], SOL_SOCKET, SO_TYPE, &type, &tl) == 0 &&
                type == SOCK_STREAM && fcntl(fds[j], F_SETFL, O_NONBLOCK) == 0)
                l->pool[l->npool++] = fds[j];
            else
                close(fds[j]);
        }
        if (n > 0 && k == 0 && l->handoff == 2 && byte == 'c') {
            unsigned char token[DIALBACK_TOKEN];
            if (fwd_token(l->ctl, token) == 0) {
                fwd_dialback(l, token);
                continue;
            }
            n = 0; /* a token cut short: the relay is not one we understand */
        }
        if (n > 0)
            continue;
        close(l->ctl);
        l->ctl = -1;
        while (l->npool > 0)
            close(l->pool[--l->npool]);
        for (size_t k = 0; k < npairs; k++)
            if (pairs[k].pooled && pairs[k].li == (size_t)(l - lis) && !pairs[k].dead) {
                pairs[k].pooled = 0; /* nobody to report to */
                fwd_close(&pairs[k]);
            }
        return;
    }
}

/* Before hello: each service listener's pool connection to its relay ('P'). Without one
 * (the relay refused it, or it is not there) every connection dials the relay. */
static void fwd_pools_open(void) {
    for (size_t i = 0; i < nlis; i++) {
        if (!lis[i].handoff)
            continue;
        int busy;
        int u = unix_dial(lis[i].path, 0, &busy);
        if (u < 0)
            continue;
        int size = 1 << 20;
        setsockopt(u, SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
        if (send(u, lis[i].handoff == 2 ? "I" : "P", 1, MSG_NOSIGNAL) != 1 ||
            fcntl(u, F_SETFL, O_NONBLOCK) < 0) {
            close(u);
            continue;
        }
        lis[i].ctl = u;
    }
}

/* A relay's first byte, with its connected socket (module comment above the listeners):
 * 0 when done (handed over, or the relay splices), -1 when the relay refused (it closed: the
 * grant's service did not answer). */
static int fwd_take(struct pair *c) {
    char byte;
    int fds[FDS_PER_BYTE], flags;
    size_t k;
    ssize_t n = recv_byte_fds(c->fd[1], &byte, fds, &k, &flags);
    if (n < 0)
        return errno == EAGAIN || errno == EINTR ? 0 : -1;
    int got = -1;
    for (size_t j = 0; j < k; j++) {
        if (got < 0)
            got = fds[j];
        else
            close(fds[j]); /* one socket per connection: anything more is not ours */
    }
    if (n == 0) {
        if (got >= 0)
            close(got);
        return -1;
    }
    c->awaiting = 0;
    int type = 0;
    socklen_t tl = sizeof type;
    if (got >= 0 && (flags & MSG_CTRUNC || getsockopt(got, SOL_SOCKET, SO_TYPE, &type, &tl) < 0 ||
                     type != SOCK_STREAM)) {
        close(got);
        got = -1;
    }
    if (got < 0 || fcntl(got, F_SETFL, O_NONBLOCK) < 0) {
        if (got >= 0)
            close(got);
        /* No socket came through: the relay splices this connection. */
        return send(c->fd[1], "S", 1, MSG_DONTWAIT | MSG_NOSIGNAL) == 1 ? 0 : -1;
    }
    if (send(c->fd[1], "K", 1, MSG_DONTWAIT | MSG_NOSIGNAL) != 1) {
        close(got);
        return -1;
    }
    c->report = c->fd[1];
    c->fd[1] = got;
    fwd_pipes(c);
    return 0;
}

/* fwd_flow through the half's pipe (splice: pages move, bytes are not copied). */
static int fwd_splice(struct half *h, int src, int dst) {
    if (!h->eof && h->len < h->cap) {
        ssize_t n = splice(src, NULL, h->pipe[1], NULL, h->cap - h->len,
                           SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
        if (n > 0)
            h->len += (size_t)n;
        else if (n == 0)
            h->eof = 1;
        else if (errno != EAGAIN && errno != EINTR)
            return -1;
    }
    while (h->len > 0) {
        ssize_t w = splice(h->pipe[0], NULL, dst, NULL, h->len, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
        if (w < 0) {
            if (errno == EAGAIN || errno == EINTR)
                break;
            return -1;
        }
        h->len -= (size_t)w;
        h->moved += (unsigned long long)w;
    }
    if (h->eof && h->len == 0 && !h->shut) {
        shutdown(dst, SHUT_WR);
        h->shut = 1;
    }
    return 0;
}

/* Move what can move from fd[i] to fd[1-i], without blocking. Returns -1 on a broken side. */
static int fwd_flow(struct pair *c, int i) {
    struct half *h = &c->h[i];
    int src = c->fd[i], dst = c->fd[1 - i];
    if (h->pipe[0] >= 0)
        return fwd_splice(h, src, dst);
    if (!h->buf)
        h->buf = xrealloc(NULL, FWD_BUF);
    if (!h->eof && h->len == 0) {
        ssize_t n = recv(src, h->buf, FWD_BUF, MSG_DONTWAIT);
        if (n > 0) {
            h->len = (size_t)n;
            h->off = 0;
        } else if (n == 0) {
            h->eof = 1;
        } else if (errno != EAGAIN && errno != EINTR) {
            return -1;
        }
    }
    while (h->off < h->len) {
        ssize_t w = send(dst, h->buf + h->off, h->len - h->off, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EAGAIN || errno == EINTR)
                break;
            return -1;
        }
        h->off += (size_t)w;
        h->moved += (unsigned long long)w;
    }
    if (h->off == h->len)
        h->len = h->off = 0;
    if (h->eof && h->len == 0 && !h->shut) {
        shutdown(dst, SHUT_WR);
        h->shut = 1;
    }
    return 0;
}

static void fwd_close(struct pair *c) {
    if (c->report >= 0) {
        /* The counts for the relay's audit event: 16 bytes into an otherwise idle socket. */
        unsigned char counts[16];
        for (int i = 0; i < 2; i++)
            for (int b = 0; b < 8; b++)
                counts[8 * i + b] = (unsigned char)(c->h[i].moved >> (56 - 8 * b));
        if (send(c->report, counts, sizeof counts, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
            /* the relay is gone: nobody to tell */
        }
        close(c->report);
    }
    if (c->pooled)
        fwd_record(c->li, 'D', c->id, c->h[0].moved, c->h[1].moved, c->err);
    for (int i = 0; i < 2; i++) {
        close(c->fd[i]);
        free(c->h[i].buf);
        for (int j = 0; j < 2; j++)
            if (c->h[i].pipe[j] >= 0)
                close(c->h[i].pipe[j]);
    }
    c->dead = 1;
}

/* The forwarder's pollfds (two per listener: it and its pool connection; then FWD_SLOTS per
 * connection) into p; returns how many. A side with nothing to wait for is left out (fd -1),
 * so a hang-up cannot spin the loop. */
static size_t fwd_fill(struct pollfd *p) {
    size_t n = 0;
    if (nlis == 0)
        return 0;
    for (size_t i = 0; i < nlis; i++) {
        p[n++] = (struct pollfd){npairs < FWD_MAX ? lis[i].fd : -1, POLLIN, 0};
        p[n++] = (struct pollfd){lis[i].ctl, POLLIN, 0};
    }
    for (size_t k = 0; k < npairs; k++) {
        struct pair *c = &pairs[k];
        if (c->connecting) {
            /* A pool socket's connect to the grant: writable when done either way. */
            p[n++] = (struct pollfd){-1, 0, 0};
            p[n++] = (struct pollfd){c->fd[1], POLLOUT, 0};
            p[n++] = (struct pollfd){-1, 0, 0};
            continue;
        }
        if (c->awaiting) {
            /* Nothing moves before the relay's answer: only its socket is watched. */
            p[n++] = (struct pollfd){-1, 0, 0};
            p[n++] = (struct pollfd){c->deadline ? -1 : c->fd[1], POLLIN, 0};
            p[n++] = (struct pollfd){-1, 0, 0};
            continue;
        }
        for (int i = 0; i < 2; i++) {
            short ev = 0;
            if (!c->deadline) {
                struct half *h = &c->h[i];
                if (!h->eof && (h->pipe[0] >= 0 ? h->len < h->cap : h->len == 0))
                    ev |= POLLIN;
                if (c->h[1 - i].len > c->h[1 - i].off)
                    ev |= POLLOUT;
            }
            p[n++] = (struct pollfd){ev ? c->fd[i] : -1, ev, 0};
        }
        /* The relay says nothing after 'K' but its close (the task stops). */
        p[n++] = (struct pollfd){c->report, POLLIN, 0};
    }
    return n;
}

/* After poll: accept, retry connects, move data, drop finished connections. */
static void fwd_handle(struct pollfd *p) {
    if (nlis == 0)
        return;
    /* Only the connections p was filled for: a relay's message below may add some (an
     * inbound one), which have no pollfds until the next round. */
    size_t had = npairs;
    for (size_t i = 0; i < nlis; i++)
        if (p[2 * i + 1].revents && lis[i].ctl >= 0)
            fwd_ctl(&lis[i]);
    for (size_t k = 0; k < had; k++) {
        struct pair *c = &pairs[k];
        if (c->dead)
            continue;
        if (c->deadline) {
            if (fwd_retry_connect(c) < 0)
                fwd_close(c);
            else if (!c->deadline && c->awaiting &&
                     send(c->fd[1], "C", 1, MSG_DONTWAIT | MSG_NOSIGNAL) != 1)
                fwd_close(c);
            continue;
        }
        struct pollfd *q = &p[2 * nlis + FWD_SLOTS * k];
        if (!(q[0].revents | q[1].revents | q[2].revents))
            continue;
        if (c->connecting) {
            int err = 0;
            socklen_t el = sizeof err;
            if (getsockopt(c->fd[1], SOL_SOCKET, SO_ERROR, &err, &el) < 0)
                err = errno;
            c->connecting = 0;
            if (err) {
                c->err = err;
                fwd_close(c);
            }
            continue;
        }
        if (c->awaiting) {
            if (fwd_take(c) < 0)
                fwd_close(c);
            continue;
        }
        if (q[2].revents) {
            fwd_close(c);
            continue;
        }
        if (fwd_flow(c, 0) < 0 || fwd_flow(c, 1) < 0 || (c->h[0].shut && c->h[1].shut))
            fwd_close(c);
    }
    size_t j = 0;
    for (size_t k = 0; k < npairs; k++)
        if (!pairs[k].dead)
            pairs[j++] = pairs[k];
    npairs = j;
    for (size_t i = 0; i < nlis; i++)
        if (p[2 * i].revents)
            fwd_accept(&lis[i]);
}

static int fwd_waiting(void) {
    for (size_t k = 0; k < npairs; k++)
        if (pairs[k].deadline)
            return 1;
    return 0;
}

/* In a keeper: none of the forwarder's sockets is ours to hold. */
static void fwd_drop_inherited(void) {
    for (size_t i = 0; i < nlis; i++) {
        close(lis[i].fd);
        if (lis[i].ctl >= 0)
            close(lis[i].ctl);
        for (int j = 0; j < lis[i].npool; j++)
            close(lis[i].pool[j]);
    }
    for (size_t k = 0; k < npairs; k++) {
        for (int i = 0; i < 2; i++) {
            close(pairs[k].fd[i]);
            for (int j = 0; j < 2; j++)
                if (pairs[k].h[i].pipe[j] >= 0)
                    close(pairs[k].h[i].pipe[j]);
        }
        if (pairs[k].report >= 0)
            close(pairs[k].report);
    }
    nlis = 0;
    npairs = 0;
}

/* ---------------------------------------------------------------- granted sockets, handed over */

/* The fastest way to a granted host service is none of ours in between: when a command
 * connects a TCP socket to a grant's address (127.0.0.1:5432 of the sandbox), we connect one
 * of the relay's pool sockets (the host's network) to the grant and put it in the command's
 * place, at the same fd number, by seccomp user notification: the keeper filters its tree's
 * connect() with a listener it hands us ('L'), we read the address from the caller's memory,
 * take its socket (pidfd_getfd) to compare, and answer with SECCOMP_IOCTL_NOTIF_ADDFD
 * (SETFD). The command then talks to the service over its own socket: no splice, no hop.
 *
 * Every other connect goes on untouched (CONTINUE): the kernel decides as before, and a grant
 * we cannot hand over (no pool socket, a caller we cannot read) still reaches our listener
 * and the splice above. What the command now holds is a connected socket of the host's
 * network; it must never connect it again. A connected TCP socket is re-aimed only through
 * connect(AF_UNSPEC) then connect(): every connect() is ours to answer, and one on a socket of
 * another network namespace than the sandbox's (SO_NETNS_COOKIE) is refused (EPERM); io_uring,
 * which would connect without the syscall, is ENOSYS in the filtered tree, as are other
 * architectures' syscalls (x32, i386) that would bypass the filter's numbers. TCP fast open
 * (sendto with an address) is EISCONN on a connected socket. Without a cookie (kernel < 5.14)
 * or a listener (gVisor) nothing is handed over. */
#ifndef SO_NETNS_COOKIE
#define SO_NETNS_COOKIE 71
#endif
#ifndef SECCOMP_IOCTL_NOTIF_SET_FLAGS /* Linux 6.6; Debian 12's headers are older */
#define SECCOMP_IOCTL_NOTIF_SET_FLAGS SECCOMP_IOW(4, __u64)
#endif
#ifndef SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP
#define SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP (1UL << 0)
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#if defined(__x86_64__)
#define INJECT_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define INJECT_ARCH AUDIT_ARCH_AARCH64
#endif
#define INJECT_CONNECT_MS 100 /* at most, per connect, while the agent serves no one else */
#define IO_URING_FIRST 425 /* io_uring_setup, _enter, _register: the same on every arch */
#define IO_URING_LAST 427

static unsigned long long sandbox_cookie;
static int handed_any; /* a socket of the host's is somewhere in the sandbox now */

/* Whether connects are to be handed over: a TCP grant with its pool, and a cookie. */
static int inject_wanted(void) {
#ifdef INJECT_ARCH
    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    socklen_t cl = sizeof sandbox_cookie;
    int ok = s >= 0 && getsockopt(s, SOL_SOCKET, SO_NETNS_COOKIE, &sandbox_cookie, &cl) == 0;
    if (s >= 0)
        close(s);
    for (size_t i = 0; ok && i < nlis; i++)
        if (lis[i].handoff == 1 && lis[i].ctl >= 0)
            return 1;
#endif
    return 0;
}

/* In the keeper: the filter (no_new_privs first, as an unprivileged filter needs) and its
 * listener sent to the agent. A failure leaves the run unfiltered: nothing is handed over. */
static void inject_install(int chan) {
#ifdef INJECT_ARCH
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, INJECT_ARCH, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
#if defined(__x86_64__)
        BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000, 0, 1), /* x32 */
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
#else
        BPF_JUMP(BPF_JMP | BPF_JA, 0, 0, 0),
        BPF_JUMP(BPF_JMP | BPF_JA, 0, 0, 0),
#endif
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_connect, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_USER_NOTIF),
        BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, IO_URING_FIRST, 0, 2),
        BPF_JUMP(BPF_JMP | BPF_JGT | BPF_K, IO_URING_LAST, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {(unsigned short)(sizeof f / sizeof f[0]), f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        return;
    int lfd = (int)syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER,
                           SECCOMP_FILTER_FLAG_NEW_LISTENER, &prog);
    if (lfd < 0)
        return;
    struct kmsg m;
    memset(&m, 0, sizeof m);
    m.type = 'L';
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } cm;
    struct iovec iov = {&m, sizeof m};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cm.buf;
    mh.msg_controllen = sizeof cm.buf;
    struct cmsghdr *h = CMSG_FIRSTHDR(&mh);
    h->cmsg_level = SOL_SOCKET;
    h->cmsg_type = SCM_RIGHTS;
    h->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(h), &lfd, sizeof lfd);
    if (sendmsg(chan, &mh, MSG_NOSIGNAL) < 0) {
        /* no agent to answer: the filtered connects would wait; the kernel answers ENOSYS
         * once this last holder of the listener closes it */
    }
    close(lfd);
#else
    (void)chan;
#endif
}

static int same_address(const struct sockaddr_storage *a, size_t alen,
                        const struct sockaddr_storage *b) {
    if (a->ss_family != b->ss_family)
        return 0;
    if (a->ss_family == AF_INET && alen >= sizeof(struct sockaddr_in)) {
        const struct sockaddr_in *x = (const void *)a, *y = (const void *)b;
        return x->sin_port == y->sin_port && x->sin_addr.s_addr == y->sin_addr.s_addr;
    }
    if (a->ss_family == AF_INET6 && alen >= sizeof(struct sockaddr_in6)) {
        const struct sockaddr_in6 *x = (const void *)a, *y = (const void *)b;
        return x->sin6_port == y->sin6_port &&
               !memcmp(&x->sin6_addr, &y->sin6_addr, sizeof x->sin6_addr);
    }
    return 0;
}

/* The callers' /proc/PID/mem and pidfd, kept for their next connect (a build's or a test
 * run's process makes many): two opens less each time. A pid reused since reads nothing
 * through the old ones (its memory and process are gone), and then they are opened anew. */
#define PROC_CACHE 16
static struct {
    pid_t pid;
    int mem, pidfd;
    unsigned long long used;
} pcache[PROC_CACHE];
static unsigned long long pcache_tick;

static void pcache_close(int i) {
    if (pcache[i].pid) {
        close(pcache[i].mem);
        close(pcache[i].pidfd);
    }
    pcache[i].pid = 0;
}

/* In a keeper: none of these is its to hold. */
static void pcache_drop(void) {
    for (int i = 0; i < PROC_CACHE; i++)
        pcache_close(i);
}

/* The entry of pid (opened anew when `fresh`), or -1. */
static int pcache_get(pid_t pid, int fresh) {
    int at = -1, lru = 0;
    for (int i = 0; i < PROC_CACHE; i++) {
        if (pcache[i].pid == pid)
            at = i;
        if (pcache[i].used < pcache[lru].used)
            lru = i;
    }
    if (at >= 0 && !fresh) {
        pcache[at].used = ++pcache_tick;
        return at;
    }
    if (at < 0)
        at = lru;
    pcache_close(at);
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/mem", (int)pid);
    int mem = open(path, O_RDONLY | O_CLOEXEC);
    if (mem < 0)
        return -1;
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (pidfd < 0) {
        close(mem);
        return -1;
    }
    pcache[at].pid = pid;
    pcache[at].mem = mem;
    pcache[at].pidfd = pidfd;
    pcache[at].used = ++pcache_tick;
    return at;
}

/* Whether fd `fd` of `pid` is close-on-exec (its fdinfo's flags, octal). */
static int fd_cloexec(pid_t pid, int fd) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/fdinfo/%d", (int)pid, fd);
    int f = open(path, O_RDONLY | O_CLOEXEC);
    if (f < 0)
        return 1;
    ssize_t n = read(f, buf, sizeof buf - 1);
    close(f);
    if (n <= 0)
        return 1;
    buf[n] = 0;
    char *flags = strstr(buf, "flags:");
    return flags ? (strtol(flags + 6, NULL, 8) & O_CLOEXEC) != 0 : 1;
}

/* A pool socket taken and not handed over (its connect failed: err): the relay audits it. */
static void inject_untaken(size_t li, unsigned id, int s, int err) {
    fwd_record(li, 'O', id, 0, 0, 0);
    fwd_record(li, 'D', id, 0, 0, err);
    close(s);
}

/* A pool socket of l, connected to the grant, in the place of the caller's socket. 0: done
 * (the connect returns 0), > 0: the errno it returns, -1: let it go on as it would. */
static int inject_pooled(int lfd, struct seccomp_notif *req, struct listener *l, int sfd) {
    size_t li = (size_t)(l - lis);
    int s = l->pool[--l->npool];
    unsigned id = l->next_id++;
    /* One record when it goes well ('H': taken and handed over), 'O' and 'D' when not: the
     * relay's next socket and its audit event cost it one wake-up per connection. */
    int r = connect(s, (struct sockaddr *)&l->to, l->tolen);
    int err = r < 0 ? errno : 0;
    if (r < 0 && err == EINPROGRESS) {
        /* A loopback connect is done at once unless the service's backlog is full: then we
         * do not wait (the agent serves the whole sandbox), and the command's connect goes
         * on to our listener, where a connect in progress waits in the poll loop. */
        struct pollfd w = {s, POLLOUT, 0};
        socklen_t el = sizeof err;
        if (poll(&w, 1, INJECT_CONNECT_MS) != 1 ||
            getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &el) < 0) {
            inject_untaken(li, id, s, ETIMEDOUT);
            return -1;
        }
    }
    if (err) {
        inject_untaken(li, id, s, err);
        return err; /* the grant refused: the command's connect says so */
    }
    int fl = fcntl(sfd, F_GETFL);
    if (fcntl(s, F_SETFL, fl >= 0 && (fl & O_NONBLOCK) ? O_NONBLOCK : 0) < 0) {
        /* as it was: non-blocking */
    }
    /* What a client sets before its connect, carried over (buffer sizes are not: setting
     * one turns the kernel's autotuning off, and it cannot be told whether one was set). */
    static const int opts[][2] = {
        {IPPROTO_TCP, TCP_NODELAY},   {SOL_SOCKET, SO_KEEPALIVE},  {SOL_SOCKET, SO_RCVTIMEO},
        {SOL_SOCKET, SO_SNDTIMEO},    {SOL_SOCKET, SO_LINGER},     {IPPROTO_TCP, TCP_KEEPIDLE},
        {IPPROTO_TCP, TCP_KEEPINTVL}, {IPPROTO_TCP, TCP_KEEPCNT},  {IPPROTO_TCP, TCP_USER_TIMEOUT},
    };
    for (size_t i = 0; i < sizeof opts / sizeof opts[0]; i++) {
        char v[32]; /* an int, a struct timeval or a struct linger */
        socklen_t vl = sizeof v;
        if (getsockopt(sfd, opts[i][0], opts[i][1], v, &vl) == 0)
            setsockopt(s, opts[i][0], opts[i][1], v, vl);
    }
    struct seccomp_notif_addfd add;
    memset(&add, 0, sizeof add);
    add.id = req->id;
    add.flags = SECCOMP_ADDFD_FLAG_SETFD;
    add.srcfd = (unsigned)s;
    add.newfd = (unsigned)req->data.args[0];
    add.newfd_flags = fd_cloexec(req->pid, (int)req->data.args[0]) ? O_CLOEXEC : 0;
    if (ioctl(lfd, SECCOMP_IOCTL_NOTIF_ADDFD, &add) < 0) {
        inject_untaken(li, id, s, errno ? errno : EBADF);
        return -1;
    }
    fwd_hold(li, id); /* the command's own now: its relay audits it so */
    handed_any = 1;
    close(s);
    return 0;
}

/* A connect we cannot look into (its caller made itself non-dumpable: no /proc/PID/mem, no
 * pidfd_getfd for us) may be on a socket we handed over, passed or inherited: once one is in
 * the sandbox it is refused, before it goes on as it would. */
static int uninspectable(void) {
    return handed_any ? EPERM : -1;
}

static int inject_connect(int lfd, struct seccomp_notif *req) {
    if (req->data.nr != SYS_connect)
        return -1;
    struct sockaddr_storage sa;
    memset(&sa, 0, sizeof sa);
    size_t alen = (size_t)(socklen_t)req->data.args[2];
    if (alen > sizeof sa)
        alen = sizeof sa;
    pid_t pid = (pid_t)req->pid;
    int sfd = -1, getfd_err = 0;
    for (int fresh = 0; fresh < 2 && sfd < 0; fresh++) {
        int at = pcache_get(pid, fresh);
        if (at < 0) /* gone (it says nothing more), or not ours to read */
            return errno == ESRCH || errno == ENOENT ? -1 : uninspectable();
        ssize_t n = alen ? pread(pcache[at].mem, &sa, alen, (off_t)req->data.args[1]) : 0;
        if (n != (ssize_t)alen) {
            if (fresh)
                return -1; /* a bad address: the kernel says EFAULT */
            continue;      /* perhaps an old process's: look again */
        }
        sfd = (int)syscall(SYS_pidfd_getfd, pcache[at].pidfd, (int)req->data.args[0], 0);
        getfd_err = errno;
        if (sfd < 0 && (getfd_err == EBADF || fresh))
            return getfd_err == EBADF ? -1 : uninspectable(); /* EBADF: the kernel says so too */
    }
    if (sfd < 0)
        return -1;
    int ret = -1;
    unsigned long long cookie = 0;
    socklen_t cl = sizeof cookie;
    int type = 0, proto = 0, dom = 0;
    socklen_t tl = sizeof type, pl = sizeof proto, dl = sizeof dom;
    /* The pid we read is still the caller's, in this very call. */
    if (ioctl(lfd, SECCOMP_IOCTL_NOTIF_ID_VALID, &req->id) < 0)
        goto out;
    if (getsockopt(sfd, SOL_SOCKET, SO_NETNS_COOKIE, &cookie, &cl) == 0 &&
        cookie != sandbox_cookie) {
        ret = EPERM; /* a socket of another network namespace: one we handed over */
        goto out;
    }
    if (getsockopt(sfd, SOL_SOCKET, SO_TYPE, &type, &tl) < 0 || type != SOCK_STREAM ||
        getsockopt(sfd, SOL_SOCKET, SO_PROTOCOL, &proto, &pl) < 0 || proto != IPPROTO_TCP ||
        getsockopt(sfd, SOL_SOCKET, SO_DOMAIN, &dom, &dl) < 0 || dom != sa.ss_family)
        goto out;
    for (size_t i = 0; i < nlis; i++) {
        struct listener *l = &lis[i];
        if (l->handoff == 1 && l->ctl >= 0 && l->npool > 0 && same_address(&sa, alen, &l->to)) {
            ret = inject_pooled(lfd, req, l, sfd);
            break;
        }
    }
out:
    close(sfd);
    return ret;
}

/* One notification of listener *lfd (-1 once it is finished). */
static void inject_handle(int *lfd) {
    struct seccomp_notif req;
    memset(&req, 0, sizeof req);
    if (ioctl(*lfd, SECCOMP_IOCTL_NOTIF_RECV, &req) < 0) {
        if (errno == ENOENT || errno == EINTR)
            return; /* a caller killed while it waited (supervisor.py says why) */
        close(*lfd);
        *lfd = -1;
        return;
    }
    int r = inject_connect(*lfd, &req);
    struct seccomp_notif_resp resp;
    memset(&resp, 0, sizeof resp);
    resp.id = req.id;
    if (r < 0)
        resp.flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
    else
        resp.error = r ? -r : 0;
    if (ioctl(*lfd, SECCOMP_IOCTL_NOTIF_SEND, &resp) < 0) {
        /* the caller died meanwhile */
    }
}

/* ---------------------------------------------------------------- the agent */

struct run {
    char id[128];
    pid_t keeper;
    int chan;
    int reported; /* the keeper sent its 'X' or 'F' */
    int reaped;
    int notif; /* its tree's connect listener (granted sockets, handed over), or -1 */
};

static int *fdq; /* fds received and not yet handed to a spawn */
static size_t fdq_len;
static struct run *runs;
static size_t nruns;
static int sigfd = -1;

static void send_failed(const char *id, int err, const char *what) {
    struct out o;
    out_begin(&o, 'F');
    out_field(&o, "id", "%s", id);
    out_field(&o, "errno", "%d", err);
    out_field(&o, "what", "%s", what);
    out_send(&o);
}

static void start_run(char *body, size_t len, int fds[3]) {
    struct spawn sp;
    const char *bad = parse_spawn(body, len, &sp);
    if (bad || strlen(sp.id) >= sizeof runs[0].id) {
        send_failed(sp.id ? sp.id : "", EINVAL, bad ? bad : "id too long");
        goto done;
    }
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) < 0) {
        send_failed(sp.id, errno, "socketpair");
        goto done;
    }
    pid_t pid = fork();
    if (pid < 0) {
        send_failed(sp.id, errno, "fork");
        close(pair[0]);
        close(pair[1]);
        goto done;
    }
    if (pid == 0) {
        /* The keeper holds nothing of the agent's but the connection (CLOEXEC, closed in the
         * command), to report on: not other runs' channels or fds. */
        close(sigfd);
        for (size_t i = 0; i < nruns; i++) {
            if (runs[i].chan >= 0)
                close(runs[i].chan);
            if (runs[i].notif >= 0)
                close(runs[i].notif);
        }
        close(pair[0]);
        for (size_t i = 0; i < fdq_len; i++)
            close(fdq[i]); /* the fds of spawns still queued belong to other runs */
        fwd_drop_inherited();
        pcache_drop();
        keeper_main(&sp, fds, pair[1]);
    }
    close(pair[1]);
    runs = xrealloc(runs, (nruns + 1) * sizeof *runs);
    struct run *r = &runs[nruns++];
    memset(r, 0, sizeof *r);
    snprintf(r->id, sizeof r->id, "%s", sp.id);
    r->keeper = pid;
    r->chan = pair[0];
    r->notif = -1;
done:
    for (int i = 0; i < 3; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    free_spawn(&sp);
}

static struct run *find_run(const char *id) {
    for (size_t i = 0; i < nruns; i++)
        if (!runs[i].reported && !strcmp(runs[i].id, id))
            return &runs[i];
    return NULL;
}

static void kill_run(char *body, size_t len) {
    const char *id = NULL;
    long sig = SIGTERM, tree = 1, grace = 2000, x;
    if (len == 0 || body[len - 1] != 0)
        return;
    for (char *f = body, *next; f < body + len; f = next) {
        next = f + strlen(f) + 1;
        char *eq = strchr(f, '=');
        if (!eq)
            return;
        *eq = 0;
        if (!strcmp(f, "id"))
            id = eq + 1;
        else if (parse_long(eq + 1, &x, 10) == 0) {
            if (!strcmp(f, "signal"))
                sig = x;
            else if (!strcmp(f, "tree"))
                tree = x;
            else if (!strcmp(f, "grace_ms"))
                grace = x;
        }
    }
    struct run *r = id ? find_run(id) : NULL;
    if (!r || r->chan < 0 || sig <= 0 || sig >= NSIG)
        return; /* already over: nothing to end */
    struct kmsg k;
    memset(&k, 0, sizeof k);
    k.type = 'K';
    k.sig = (int32_t)sig;
    k.tree = tree != 0;
    k.grace_ms = grace < 0 ? 0 : grace > 600000 ? 600000 : (int32_t)grace;
    send(r->chan, &k, sizeof k, MSG_NOSIGNAL);
}

/* Read what the keeper of r says. Returns 0 when its channel is finished. */
static int keeper_said(struct run *r) {
    struct kmsg m;
    int fds[FDS_PER_BYTE], flags;
    size_t k;
    ssize_t n = recv_with_fds(r->chan, &m, sizeof m, fds, &k, &flags);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return 1;
    if (n != (ssize_t)sizeof m) {
        for (size_t j = 0; j < k; j++)
            close(fds[j]);
        close(r->chan);
        r->chan = -1;
        return 0;
    }
    for (size_t j = 0; j < k; j++) {
        if (m.type == 'L' && j == 0 && r->notif < 0 && inject_on) {
            r->notif = fds[j];
            /* The caller's connect waits for us: its CPU is handed to us and back
             * (SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP, Linux 6.6), not a wake-up of another CPU
             * each way. Older kernels refuse the flag: the notification works as before. */
            (void)ioctl(r->notif, SECCOMP_IOCTL_NOTIF_SET_FLAGS,
                        (unsigned long)SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP);
        } else
            close(fds[j]);
    }
    if (m.type == 'D')
        r->reported = 1;
    return 1;
}

static void forget_finished(void) {
    size_t j = 0;
    for (size_t i = 0; i < nruns; i++) {
        if (runs[i].reaped && runs[i].chan < 0) {
            if (runs[i].notif >= 0)
                close(runs[i].notif);
            continue;
        }
        runs[j++] = runs[i];
    }
    nruns = j;
}

static void agent_reap(void) {
    int st;
    pid_t p;
    while ((p = waitpid(-1, &st, WNOHANG)) > 0) {
        for (size_t i = 0; i < nruns; i++) {
            struct run *r = &runs[i];
            if (r->keeper != p)
                continue;
            r->reaped = 1;
            /* Its last words are already in the channel: read them before judging. */
            while (r->chan >= 0 && keeper_said(r)) {
            }
            if (!r->reported) {
                /* The keeper died before it could tell: the run is over, by SIGKILL. */
                struct out o;
                out_begin(&o, 'X');
                out_field(&o, "id", "%s", r->id);
                out_field(&o, "status", "%d", SIGKILL);
                out_send(&o);
                r->reported = 1;
                /* Its orphans re-parented to us (we are a subreaper): end them. */
                pid_t *pids;
                size_t n = descendants(getpid(), &pids);
                for (size_t k = 0; k < n; k++) {
                    int keeper = 0;
                    for (size_t q = 0; q < nruns; q++)
                        keeper |= runs[q].keeper == pids[k] && !runs[q].reaped;
                    if (!keeper)
                        kill(pids[k], SIGKILL);
                }
                free(pids);
            }
        }
        /* anything else: an orphan we inherited as PID 1 or subreaper; reaped, done */
    }
    forget_finished();
}

static void shutdown_all(void) {
    for (size_t i = 0; i < nlis; i++)
        fwd_flush_held(i); /* every handed-over connection is audited */
    /* Each keeper sees its channel close and ends its tree (SIGTERM, grace, SIGKILL). */
    for (size_t i = 0; i < nruns; i++)
        if (runs[i].chan >= 0) {
            close(runs[i].chan);
            runs[i].chan = -1;
        }
    long long deadline = now_ms() + SHUTDOWN_GRACE_MS + KILL_LOOP_MS + 2000;
    while (has_children() && now_ms() < deadline) {
        while (waitpid(-1, NULL, WNOHANG) > 0) {
        }
        sleep_ms(5);
    }
    /* Anything left is ours (we are a subreaper): no child, nothing to look for in /proc. */
    long long last = now_ms() + KILL_LOOP_MS;
    while (has_children() && signal_tree(SIGKILL, 0) && now_ms() < last) {
        while (waitpid(-1, NULL, WNOHANG) > 0) {
        }
        sleep_ms(5);
    }
    exit(0);
}

/* ---------------------------------------------------------------- reading the connection */

static char *in;
static size_t in_len, in_cap;

static void take_fds(struct msghdr *mh) {
    for (struct cmsghdr *c = CMSG_FIRSTHDR(mh); c; c = CMSG_NXTHDR(mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        fdq = xrealloc(fdq, (fdq_len + n) * sizeof *fdq);
        memcpy(fdq + fdq_len, CMSG_DATA(c), n * sizeof(int));
        fdq_len += n;
    }
}

static void handle_frame(char type, char *body, size_t len) {
    if (type == 'S') {
        int fds[3] = {-1, -1, -1};
        if (fdq_len >= 3) {
            memcpy(fds, fdq, sizeof fds);
            memmove(fdq, fdq + 3, (fdq_len - 3) * sizeof *fdq);
            fdq_len -= 3;
            start_run(body, len, fds);
        } else {
            struct spawn sp;
            parse_spawn(body, len, &sp);
            send_failed(sp.id ? sp.id : "", EBADF, "spawn needs 3 fds (stdin, stdout, stderr)");
            free_spawn(&sp);
        }
    } else if (type == 'K') {
        kill_run(body, len);
    }
    /* unknown types are ignored: a newer host may send more */
}

/* Returns 0 when the connection is over. */
static int read_conn(void) {
    if (in_cap - in_len < 65536) {
        in_cap = in_cap ? in_cap * 2 : 262144;
        in = xrealloc(in, in_cap);
    }
    char cbuf[CMSG_SPACE(sizeof(int) * 48)];
    struct iovec iov = {in + in_len, in_cap - in_len};
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    ssize_t n = recvmsg(conn, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0)
        return errno == EAGAIN || errno == EINTR;
    take_fds(&mh);
    if (n == 0 || (mh.msg_flags & MSG_CTRUNC))
        return 0; /* closed, or fds lost: we cannot trust the stream any more */
    in_len += (size_t)n;
    size_t off = 0;
    while (in_len - off >= 4) {
        unsigned char *h = (unsigned char *)in + off;
        uint32_t flen = (uint32_t)h[0] << 24 | (uint32_t)h[1] << 16 | (uint32_t)h[2] << 8 | h[3];
        if (flen == 0 || flen > MAX_FRAME)
            return 0;
        if (in_len - off - 4 < flen)
            break;
        handle_frame(in[off + 4], in + off + 5, flen - 1);
        off += 4 + flen;
    }
    memmove(in, in + off, in_len - off);
    in_len -= off;
    return 1;
}

static void connect_to(const char *path) {
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof sa.sun_path)
        die("socket path too long: %s", path);
    strcpy(sa.sun_path, path);
    conn = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (conn < 0)
        die("socket: %s", strerror(errno));
    /* The host listens before it starts us; retry briefly in case of a slow bind. */
    for (int i = 0; connect(conn, (struct sockaddr *)&sa, sizeof sa) < 0; i++) {
        if (i >= 100 || (errno != ENOENT && errno != ECONNREFUSED && errno != EINTR))
            die("connect %s: %s", path, strerror(errno));
        sleep_ms(10);
    }
}

/* --exec-status: run one command and say how it ended ("exit N" or "signal N") on status_fd
 * (--exec-status-file: in a file we create, for a launcher that cannot pass an fd: runsc).
 * A launcher that reports a signal as 128+N (bwrap, runc, an init like tini) cannot tell a
 * command's own `exit 130` from death by SIGINT; this, placed between the launcher and the
 * command, can. We exit as the launcher would have reported the command (128+N for a signal),
 * so nothing else changes. The signals an init forwards (TERM, INT, HUP, QUIT, USR1, USR2)
 * are passed on to the command, so we are transparent to them; SIGKILL ends us too, and then
 * no status is written and the launcher's own status stands. */
static int exec_status_main(int status_fd, char **argv) {
    static const int forwarded[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};
    sigset_t set, old;
    sigemptyset(&set);
    for (size_t i = 0; i < sizeof forwarded / sizeof *forwarded; i++)
        sigaddset(&set, forwarded[i]);
    sigaddset(&set, SIGCHLD);
    sigprocmask(SIG_BLOCK, &set, &old);
    if (fcntl(status_fd, F_SETFD, FD_CLOEXEC) < 0)
        die("--exec-status %d: %s", status_fd, strerror(errno));
    pid_t pid = fork();
    if (pid < 0)
        die("fork: %s", strerror(errno));
    if (pid == 0) {
        sigprocmask(SIG_SETMASK, &old, NULL);
        execvp(argv[0], argv);
        int err = errno;
        dprintf(2, "fusion-oci-agent: %s: %s\n", argv[0], strerror(err));
        _exit(err == ENOENT ? 127 : 126);
    }
    int st;
    for (;;) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid)
            break;
        if (r < 0 && errno != EINTR)
            die("waitpid: %s", strerror(errno));
        int sig = sigwaitinfo(&set, NULL);
        if (sig > 0 && sig != SIGCHLD)
            kill(pid, sig);
    }
    if (WIFSIGNALED(st)) {
        dprintf(status_fd, "signal %d\n", WTERMSIG(st));
        return 128 + WTERMSIG(st);
    }
    dprintf(status_fd, "exit %d\n", WEXITSTATUS(st));
    return WEXITSTATUS(st);
}

/* `connect HOST PORT`: a tunnel through the egress proxy on stdin/stdout, for ssh's
 * ProxyCommand (git over ssh in a filtered sandbox). The proxy is the unix socket bound into
 * the sandbox, or, where there is none (landlock: no network namespace), the address of the
 * command's HTTPS_PROXY. One CONNECT; anything but 200 is printed to stderr (the proxy's
 * reason for a denial) and is exit 1. */
#define EGRESS_SOCKET "/run/fusion-oci/egress.sock"

static int dial_env_proxy(void) {
    static const char *names[] = {"https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        const char *v = getenv(names[i]);
        if (!v || !*v)
            continue;
        if (!strncmp(v, "http://", 7))
            v += 7;
        char hostport[64];
        snprintf(hostport, sizeof hostport, "%.*s", (int)strcspn(v, "/"), v);
        char *colon = strrchr(hostport, ':');
        if (!colon)
            continue;
        *colon = 0;
        long port;
        struct sockaddr_in sa;
        memset(&sa, 0, sizeof sa);
        sa.sin_family = AF_INET;
        if (parse_long(colon + 1, &port, 10) < 0 || port <= 0 || port > 65535 ||
            inet_pton(AF_INET, hostport, &sa.sin_addr) != 1)
            continue; /* only a numeric loopback-style address: we resolve nothing */
        sa.sin_port = htons((uint16_t)port);
        int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (s >= 0 && connect(s, (struct sockaddr *)&sa, sizeof sa) == 0)
            return s;
        if (s >= 0)
            close(s);
    }
    return -1;
}

static int connect_main(const char *host, const char *port_s) {
    long port;
    if (parse_long(port_s, &port, 10) < 0 || port <= 0 || port > 65535)
        die("connect: bad port '%s'", port_s);
    for (const char *c = host; *c; c++)
        if ((unsigned char)*c <= ' ' || *c == 0x7f)
            die("connect: bad host name");
    if (!*host || strlen(host) > 255)
        die("connect: bad host name");
    int busy;
    int s = unix_dial(EGRESS_SOCKET, 0, &busy);
    if (s < 0 && (s = dial_env_proxy()) < 0)
        die("connect: no egress proxy (%s, or HTTPS_PROXY)", EGRESS_SOCKET);
    int v6 = strchr(host, ':') != NULL;
    char req[600];
    int n = snprintf(req, sizeof req, "CONNECT %s%s%s:%ld HTTP/1.1\r\nHost: %s%s%s:%ld\r\n\r\n",
                     v6 ? "[" : "", host, v6 ? "]" : "", port, v6 ? "[" : "", host,
                     v6 ? "]" : "", port);
    if (write_all(s, req, (size_t)n) < 0)
        die("connect: %s", strerror(errno));
    /* The answer's head, byte by byte: nothing of the tunnel is read past it. */
    char head[8192];
    size_t len = 0;
    while (len < sizeof head - 1 && (len < 4 || memcmp(head + len - 4, "\r\n\r\n", 4))) {
        ssize_t r = read(s, head + len, 1);
        if (r <= 0)
            break;
        len++;
    }
    head[len] = 0;
    if (strncmp(head, "HTTP/1.", 7) || strncmp(head + 8, " 200", 4)) {
        fprintf(stderr, "fusion-oci-agent: the egress proxy refused %s:%ld:\n%s", host, port,
                head);
        char body[4096];
        ssize_t r = read(s, body, sizeof body);
        if (r > 0)
            fwrite(body, 1, (size_t)r, stderr);
        fputc('\n', stderr);
        return 1;
    }
    /* Splice stdin -> proxy and proxy -> stdout until the proxy side ends. */
    char buf[65536];
    int in_open = 1;
    for (;;) {
        struct pollfd p[2] = {{in_open ? 0 : -1, POLLIN, 0}, {s, POLLIN, 0}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            return 1;
        }
        if (p[0].revents) {
            ssize_t r = read(0, buf, sizeof buf);
            if (r > 0) {
                if (write_all(s, buf, (size_t)r) < 0)
                    return 1;
            } else {
                in_open = 0;
                shutdown(s, SHUT_WR);
            }
        }
        if (p[1].revents) {
            ssize_t r = read(s, buf, sizeof buf);
            if (r <= 0)
                return 0;
            if (write_all(1, buf, (size_t)r) < 0)
                return 1;
        }
    }
}

/* `forward PATH`: the forwarder alone, for a sandbox whose agent is not its init (oci runs a
 * container per command): until killed. */
__attribute__((noreturn)) static void forward_loop(void);
__attribute__((noreturn)) static void forward_main(const char *path) {
    add_listener("127.0.0.1", FWD_PORT, path, 0);
    forward_loop();
}

/* `--egress PATH --exec-status-file F -- ARGV` (oci: a container per command, whose init is
 * not the agent): the forwarder listens before the command starts (no command can take the
 * port first, none connects before it listens), then serves in a child of ours for the
 * command's life: it dies with us (PDEATHSIG) and with the container's pid namespace. */
static void forward_beside(void) {
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0)
        die("fork: %s", strerror(errno));
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
        if (getppid() != parent)
            _exit(0);
        prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
        forward_loop();
    }
    for (size_t i = 0; i < nlis; i++) {
        close(lis[i].fd);
        if (lis[i].ctl >= 0)
            close(lis[i].ctl);
    }
    nlis = 0;
}

__attribute__((noreturn)) static void forward_loop(void) {
    struct pollfd *p = NULL;
    for (;;) {
        p = xrealloc(p, (2 * nlis + FWD_SLOTS * npairs) * sizeof *p);
        size_t np = fwd_fill(p);
        if (poll(p, np, fwd_waiting() ? 10 : -1) < 0 && errno != EINTR)
            die("poll: %s", strerror(errno));
        fwd_handle(p);
    }
}

int main(int argc, char **argv) {
    pid_t parent = 0;
    int dumpable = 0;
    const char *connect_path = NULL;
    const char *egress_path = NULL;
    char *services[FWD_LISTENERS];
    int nservices = 0;
    char *publish[FWD_LISTENERS];
    int npublish = 0;
    /* `--egress PATH` and `--service SPEC`s before `--exec-status-file F -- ARGV`. */
    int lead = 1;
    while (lead + 1 < argc &&
           (!strcmp(argv[lead], "--egress") || !strcmp(argv[lead], "--service")))
        lead += 2;
    if (lead > 1 && argc > lead + 3 && !strcmp(argv[lead], "--exec-status-file")) {
        for (int i = 1; i < lead; i += 2) {
            if (!strcmp(argv[i], "--egress"))
                add_listener("127.0.0.1", FWD_PORT, argv[i + 1], 0);
            else
                add_service(argv[i + 1]);
        }
        fwd_pools_open();
        forward_beside();
        argv[lead - 1] = argv[0];
        argv += lead - 1;
        argc -= lead - 1;
    }
    if (argc > 4 && !strcmp(argv[3], "--") && (!strcmp(argv[1], "--exec-status") ||
                                                !strcmp(argv[1], "--exec-status-file"))) {
        for (int s = 1; s < NSIG; s++)
            signal(s, SIG_DFL);
        int fd = argv[1][13] ? open(argv[2], O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)
                             : atoi(argv[2]);
        if (fd < 0)
            die("%s: %s", argv[2], strerror(errno));
        return exec_status_main(fd, argv + 4);
    }
    if (argc == 4 && !strcmp(argv[1], "connect"))
        return connect_main(argv[2], argv[3]);
    if (argc == 3 && !strcmp(argv[1], "forward")) {
        prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
        forward_main(argv[2]);
    }
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--fd") && i + 1 < argc)
            conn = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--connect") && i + 1 < argc)
            connect_path = argv[++i];
        else if (!strcmp(argv[i], "--egress") && i + 1 < argc)
            egress_path = argv[++i];
        else if (!strcmp(argv[i], "--service") && i + 1 < argc && nservices < FWD_LISTENERS - 1)
            services[nservices++] = argv[++i];
        else if (!strcmp(argv[i], "--publish") && i + 1 < argc && npublish < FWD_LISTENERS - 1)
            publish[npublish++] = argv[++i];
        else if (!strcmp(argv[i], "--parent") && i + 1 < argc)
            parent = (pid_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--dumpable"))
            dumpable = 1;
        else if (!strcmp(argv[i], "--scope-runs"))
            scope_runs = 1;
        else if (!strcmp(argv[i], "--version")) {
            puts("fusion-oci-agent protocol " PROTOCOL_VERSION);
            return 0;
        } else
            die("usage: fusion-oci-agent [--egress PATH] [--service ADDR:PORT=PATH]... [--publish PORT=PATH]... (--fd N [--parent PID] | --connect PATH)");
    }
    /* An ignored signal stays ignored across exec: whatever our parent ignored (SIGPIPE...)
     * goes back to default here, once, so every command starts with default dispositions
     * (we take our own signals through a signalfd, never a handler). */
    for (int s = 1; s < NSIG; s++)
        signal(s, SIG_DFL);
    /* Nothing in the sandbox may ptrace us or read our memory through /proc. --dumpable
     * (landlock): our opens of /proc go to a seccomp supervisor that reads their paths from
     * our memory, which an unprivileged one cannot do in a non-dumpable process (our /proc
     * walk, hence every whole-tree kill, would see nothing); there the sandbox's own profile
     * refuses ptrace, process_vm_readv/writev and pidfd_getfd, and its Landlock ruleset and
     * supervisor keep our /proc entries (mem, fd, environ) out of the commands' reach. */
    if (!dumpable)
        prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    /* Orphans of a keeper that died come to us, not to whoever is above. */
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    prctl(PR_SET_NAME, "fusion-agent", 0, 0, 0);
    if (connect_path)
        connect_to(connect_path);
    if (conn < 0)
        die("usage: fusion-oci-agent [--egress PATH] [--service ADDR:PORT=PATH]... [--publish PORT=PATH]... (--fd N [--parent PID] | --connect PATH)");
    if (fcntl(conn, F_SETFD, FD_CLOEXEC) < 0)
        die("fd %d: %s", conn, strerror(errno));
    if (parent && getppid() != parent)
        return 125; /* the host died before we started */
    sigfd = make_sigfd();
    /* Listening before hello: before any command runs, so none can take the port first. */
    if (egress_path)
        add_listener("127.0.0.1", FWD_PORT, egress_path, 0);
    for (int i = 0; i < nservices; i++)
        add_service(services[i]);
    for (int i = 0; i < npublish; i++)
        add_publish(publish[i]);
    fwd_pools_open();
    inject_on = inject_wanted();
    struct out o;
    out_begin(&o, 'H');
    out_field(&o, "version", "%s", PROTOCOL_VERSION);
    out_field(&o, "pid", "%d", (int)getpid());
    if (out_send(&o) < 0)
        shutdown_all();
    struct pollfd *p = NULL;
    for (;;) {
        p = xrealloc(p, (2 * nruns + 2 + 2 * nlis + FWD_SLOTS * npairs) * sizeof *p);
        p[0] = (struct pollfd){conn, POLLIN, 0};
        p[1] = (struct pollfd){sigfd, POLLIN, 0};
        for (size_t i = 0; i < nruns; i++) {
            p[i + 2] = (struct pollfd){runs[i].chan, POLLIN, 0};
            p[nruns + i + 2] = (struct pollfd){runs[i].notif, POLLIN, 0};
        }
        size_t nagent = 2 * nruns + 2;
        size_t np = nagent + fwd_fill(p + nagent);
        int timeout = fwd_waiting() ? 10 : fwd_held_due() ? HELD_MS : parent ? 1000 : -1;
        if (poll(p, np, timeout) < 0) {
            if (errno != EINTR)
                die("poll: %s", strerror(errno));
            for (size_t i = 0; i < np; i++)
                p[i].revents = 0;
        }
        /* Connects first: a command waits in each, and a grant's pool socket may be taken. */
        for (size_t i = 0; i < nruns; i++)
            if (p[nruns + i + 2].revents && runs[i].notif == p[nruns + i + 2].fd) {
                if (p[nruns + i + 2].revents & POLLIN)
                    inject_handle(&runs[i].notif);
                else { /* POLLHUP: every process of its tree is gone */
                    close(runs[i].notif);
                    runs[i].notif = -1;
                }
            }
        fwd_handle(p + nagent);
        np = nruns + 2;
        if (parent && getppid() != parent)
            shutdown_all(); /* the host is gone, whoever holds the socket */
        for (size_t i = 2; i < np; i++)
            if (p[i].revents && i - 2 < nruns && runs[i - 2].chan == p[i].fd)
                keeper_said(&runs[i - 2]);
        if (p[1].revents) {
            struct signalfd_siginfo si;
            while (read(sigfd, &si, sizeof si) == (ssize_t)sizeof si)
                /* As a sandbox's init, a signal from inside our pid namespace (a command: a
                 * sender outside it shows as pid 0) is not a request to end the sandbox; the
                 * host ends us by closing the connection, or signals us from outside. */
                if (si.ssi_signo != SIGCHLD && !(getpid() == 1 && si.ssi_pid != 0))
                    shutdown_all();
            agent_reap();
        }
        if (p[0].revents && !read_conn())
            shutdown_all();
        forget_finished();
    }
}
