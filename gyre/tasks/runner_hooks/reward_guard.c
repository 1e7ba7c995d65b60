/* The reward guard: preloaded into a Harbor task's test script (bash /tests/test.sh) by
 * gyre/tasks/harbor_checker.py, so that no program the script runs can write the reward.
 *
 * In the script's own shell (the process whose environment names GYRE_REWARD_GUARD_FD) it says "armed" on
 * that descriptor, removes itself from the environment, and wraps the exec functions: every program the
 * shell starts is put under a Landlock domain first, whatever that program is (static, another libc, the
 * agent's own), and keeps it with everything it starts. The domain leaves writing as it was everywhere but
 * under the logs directory (GYRE_REWARD_GUARD_LOGS): there, new files may be made and written in
 * verifier/ (ctrf.json, logs), nothing may be removed or renamed away, and nothing at all may be written in
 * .reward/, where verifier/reward.txt and reward.json point. From Landlock ABI 6 on, the domain cannot
 * signal processes outside it either (the shell, the checker). The shell itself, which writes the reward
 * (`echo 1 > /logs/verifier/reward.txt`), stays unrestricted. A program that cannot be restricted is not
 * run (exit 126).
 *
 * One program the shell starts is admitted unrestricted, as the shell's own hand: a Python interpreter given
 * the script's code inline (`python3 -c CODE`, how many tests write reward.json or scale a score), run in
 * isolated mode (-I is put first: no PYTHON* variables, no user site, neither the working directory nor a
 * script's directory on the import path), and only when nothing it loads can be the agent's: the interpreter
 * (as named and as resolved, an executable, not a script), the directories Python looks in for pyvenv.cfg and its prefix, and every
 * LD_LIBRARY_PATH entry are on read-only mounts (the image), and no LD_PRELOAD, LD_AUDIT or GCONV_PATH is
 * set. Programs started by anything restricted stay restricted: the domain is inherited, whatever they exec.
 * Build: cc -shared -fPIC -O2 -o reward_guard.so reward_guard.c -ldl
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/types.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#define CREATE_RULESET 444
#define ADD_RULE 445
#define RESTRICT_SELF 446
#define RULESET_VERSION (1U << 0)
#define RULE_PATH_BENEATH 1
#define WRITE_FILE (1ULL << 1)
#define REMOVE_DIR (1ULL << 4)
#define REMOVE_FILE (1ULL << 5)
#define MAKE_ANY (0x7fULL << 6) /* char, dir, reg, sock, fifo, block, sym */
#define REFER (1ULL << 13)
#define TRUNCATE (1ULL << 14)
#define FILE_RIGHTS (WRITE_FILE | TRUNCATE)
#define SCOPE_ABSTRACT_UNIX_SOCKET (1ULL << 0)
#define SCOPE_SIGNAL (1ULL << 1)

struct ruleset_attr {
    __u64 handled_access_fs;
    __u64 handled_access_net;
    __u64 scoped;
};
struct path_beneath_attr {
    __u64 allowed_access;
    __s32 parent_fd;
} __attribute__((packed));

static int armed;
static char logs[PATH_MAX - 16];
static char preload[PATH_MAX + 16]; /* "LD_PRELOAD=<this library>", as the shell still exports it */

__attribute__((constructor)) static void guard_init(void) {
    const char *fd = getenv("GYRE_REWARD_GUARD_FD");
    const char *dir = getenv("GYRE_REWARD_GUARD_LOGS");
    if (fd == NULL || dir == NULL || strlen(dir) >= sizeof logs)
        return;
    strcpy(logs, dir);
    snprintf(preload, sizeof preload, "LD_PRELOAD=%s", getenv("LD_PRELOAD") ? getenv("LD_PRELOAD") : "");
    armed = 1;
    if (write(atoi(fd), "armed\n", 6) != 6)
        armed = 0;
    close(atoi(fd));
    unsetenv("GYRE_REWARD_GUARD_FD");
    unsetenv("GYRE_REWARD_GUARD_LOGS");
    unsetenv("LD_PRELOAD");
}

static void allow(int ruleset, const char *path, __u64 access) {
    struct stat st;
    int fd = open(path, O_PATH | O_CLOEXEC);
    if (fd < 0)
        return;
    if (fstat(fd, &st) == 0 && !S_ISDIR(st.st_mode))
        access &= FILE_RIGHTS;
    struct path_beneath_attr rule = {.allowed_access = access, .parent_fd = fd};
    if (access)
        syscall(ADD_RULE, ruleset, RULE_PATH_BENEATH, &rule, 0); /* a refused rule grants less, never more */
    close(fd);
}

/* Every entry of `dir` but `skip1` and `skip2` gets `access`. */
static void allow_entries(int ruleset, const char *dir, const char *skip1, const char *skip2, __u64 access) {
    char path[PATH_MAX];
    struct dirent *e;
    DIR *d = opendir(dir);
    if (d == NULL)
        return;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || !strcmp(e->d_name, skip1) ||
            !strcmp(e->d_name, skip2))
            continue;
        snprintf(path, sizeof path, "%s/%s", strcmp(dir, "/") ? dir : "", e->d_name);
        allow(ruleset, path, access);
    }
    closedir(d);
}

static int restrict_self(void) {
    long abi = syscall(CREATE_RULESET, NULL, 0, RULESET_VERSION);
    if (abi < 1)
        return -1;
    __u64 handled = WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_ANY | (abi >= 2 ? REFER : 0) |
                    (abi >= 3 ? TRUNCATE : 0);
    struct ruleset_attr attr = {.handled_access_fs = handled,
                                .scoped = abi >= 6 ? SCOPE_SIGNAL | SCOPE_ABSTRACT_UNIX_SOCKET : 0};
    int ruleset = syscall(CREATE_RULESET, &attr, sizeof attr, 0);
    if (ruleset < 0)
        return -1;
    char verifier[PATH_MAX];
    snprintf(verifier, sizeof verifier, "%s/verifier", logs);
    allow_entries(ruleset, "/", logs + 1, "", handled); /* logs is a directory of the root: /logs */
    allow_entries(ruleset, logs, "verifier", ".reward", handled);
    allow(ruleset, verifier, handled & ~(REMOVE_DIR | REMOVE_FILE));
    int ok = prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 && syscall(RESTRICT_SELF, ruleset, 0) == 0;
    close(ruleset);
    return ok ? 0 : -1;
}

static void guard(void) {
    if (armed && restrict_self() != 0) {
        static const char msg[] = "reward guard: cannot restrict this program with Landlock; not running it\n";
        if (write(2, msg, sizeof msg - 1) < 0) {
        }
        _exit(126);
    }
}

/* `path` (and, with `up`, its directory and that directory's parent) is on a read-only mount. */
static int read_only(const char *path, int up) {
    char dir[PATH_MAX];
    struct statvfs vfs;
    if (strlen(path) >= sizeof dir)
        return 0;
    strcpy(dir, path);
    for (int i = 0; i <= up; i++) {
        if (statvfs(dir, &vfs) != 0 || !(vfs.f_flag & ST_RDONLY))
            return 0;
        char *slash = strrchr(dir, '/');
        if (slash == NULL)
            return 0;
        if (slash == dir)
            slash[1] = '\0';
        else
            *slash = '\0';
    }
    return 1;
}

static int python_name(const char *path) {
    const char *name = strrchr(path, '/');
    name = name ? name + 1 : path;
    if (strncmp(name, "python", 6))
        return 0;
    name += 6;
    if (*name == '3')
        name++;
    if (*name == '.' && name[1] >= '0' && name[1] <= '9')
        name += strspn(name + 1, "0123456789") + 1;
    return *name == '\0';
}

static int library_path_read_only(const char *value) {
    char entry[PATH_MAX];
    while (value && *value) {
        size_t n = strcspn(value, ":");
        if (n == 0 || n >= sizeof entry || value[0] != '/')
            return 0;
        memcpy(entry, value, n);
        entry[n] = '\0';
        if (!read_only(entry, 0))
            return 0;
        value += n + (value[n] == ':');
    }
    return 1;
}

/* An executable itself, not a script whose interpreter line would run something else with our -I. */
static int elf(const char *path) {
    char magic[4];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    int ok = read(fd, magic, 4) == 4 && !memcmp(magic, "\177ELF", 4);
    close(fd);
    return ok;
}

static const char *env_value(char *const envp[], const char *name) {
    size_t n = strlen(name);
    for (; envp && *envp; envp++)
        if (!strncmp(*envp, name, n) && (*envp)[n] == '=')
            return *envp + n + 1;
    return NULL;
}

/* The argv of an admitted `python3 -c CODE` with -I put first, or NULL: the program is restricted as any other. */
static char **admitted_python(const char *path, char *const argv[], char *const envp[]) {
    char real[PATH_MAX];
    if (!armed || path[0] != '/' || !python_name(path) || argv[0] == NULL || argv[1] == NULL ||
        strcmp(argv[1], "-c") || argv[2] == NULL)
        return NULL;
    if (env_value(envp, "LD_PRELOAD") || env_value(envp, "LD_AUDIT") || env_value(envp, "GCONV_PATH") ||
        !library_path_read_only(env_value(envp, "LD_LIBRARY_PATH")))
        return NULL;
    if (realpath(path, real) == NULL || !read_only(path, 2) || !read_only(real, 2) || !elf(real))
        return NULL;
    int argc = 0;
    while (argv[argc])
        argc++;
    char **isolated = calloc(argc + 2, sizeof *isolated);
    if (isolated == NULL)
        return NULL;
    isolated[0] = argv[0];
    isolated[1] = "-I";
    memcpy(isolated + 2, argv + 1, argc * sizeof *isolated); /* argv[1..argc-1] and the NULL */
    return isolated;
}

/* The shell's environment without the guard's own variables (bash exports what it started with): no program
 * it starts loads the guard or sees its descriptor's number. */
static char *const *without_guard(char *const envp[]) {
    int n = 0;
    while (envp && envp[n])
        n++;
    char **clean = armed ? calloc(n + 1, sizeof *clean) : NULL;
    if (clean == NULL)
        return envp;
    for (int i = 0, j = 0; i < n; i++)
        if (strcmp(envp[i], preload) && strncmp(envp[i], "GYRE_REWARD_GUARD_FD=", 21) &&
            strncmp(envp[i], "GYRE_REWARD_GUARD_LOGS=", 23))
            clean[j++] = envp[i];
    return clean;
}

#define NEXT(name) ((__typeof__(&name))dlsym(RTLD_NEXT, #name))

extern char **environ;

int execve(const char *path, char *const argv[], char *const envp[]) {
    char *const *env = without_guard(envp);
    char **isolated = admitted_python(path, argv, env);
    if (isolated != NULL)
        return NEXT(execve)(path, isolated, env);
    guard();
    return NEXT(execve)(path, argv, env);
}

int execv(const char *path, char *const argv[]) {
    return execve(path, argv, environ);
}

int execvp(const char *file, char *const argv[]) {
    guard();
    return NEXT(execvpe)(file, argv, without_guard(environ));
}

int execvpe(const char *file, char *const argv[], char *const envp[]) {
    guard();
    return NEXT(execvpe)(file, argv, without_guard(envp));
}
