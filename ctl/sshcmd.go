package ctl

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/user"
	"path"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/ident"
	"github.com/tandem-run/tandem/ctl/sshconfig"
)

// DefaultPublicKey returns the user's public key line and its file
// (identity+".pub", else ~/.ssh/id_ed25519.pub or id_rsa.pub); "" when
// there is none.
func DefaultPublicKey(identity string) (line, file string) {
	if identity != "" {
		return readKeyLine(identity + ".pub")
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return "", ""
	}
	return defaultPublicKeyIn(home)
}

// defaultPublicKeyIn is DefaultPublicKey's default under home.
func defaultPublicKeyIn(home string) (line, file string) {
	for _, f := range []string{filepath.Join(home, ".ssh", "id_ed25519.pub"), filepath.Join(home, ".ssh", "id_rsa.pub")} {
		if line, file := readKeyLine(f); file != "" {
			return line, file
		}
	}
	return "", ""
}

func readKeyLine(f string) (line, file string) {
	b, err := os.ReadFile(f)
	if err != nil {
		return "", ""
	}
	return strings.TrimSpace(string(b)), f
}

// SSHOptions say how OpenSSH logs in to a task's SSH server; where the
// server is and the way there (the runner's SSH port, the jump host, the
// key, known_hosts) are the Client's Config.
type SSHOptions struct {
	User string // login in the container (default root)
	// PinDir, when set, receives a known_hosts file of the task's host
	// keys (when its shim reports them), which the endpoint then checks.
	PinDir string
}

// SSHEndpoint is where and how OpenSSH reaches a task's SSH server.
type SSHEndpoint struct {
	Host, User string
	Port       int
	Identity   string // private key file; "" = ssh's defaults
	// HomeIdentity is the key tandem run authorized by default when $HOME
	// is not the account's home (sudo -E, a container's HOME): OpenSSH
	// looks for its default keys under the account's home, not $HOME, so
	// it is named, beside the agent's keys. "" when ssh finds it anyway.
	HomeIdentity string
	Jump         string // user@host[:port]; "" = direct
	KnownHosts   string // the jump host's known_hosts; "" = ssh's default
	// Pins is a known_hosts file holding the task's own host keys under
	// Alias (sshconfig.WritePins); "": the task's key is not checked.
	Pins, Alias string
}

// Options are the endpoint as OpenSSH -o options (ssh_config keywords),
// shared by the argv of tandem ssh and tandem's ssh config entries.
func (e SSHEndpoint) Options() [][2]string {
	opts := [][2]string{{"HostName", e.Host}, {"Port", strconv.Itoa(e.Port)}, {"User", e.User}}
	if e.Pins != "" {
		// The task's own host keys, as its runner wrote them and the shim
		// reported them: a port that another task took over since cannot
		// pass for this one.
		opts = append(opts, [2]string{"StrictHostKeyChecking", "yes"}, [2]string{"UserKnownHostsFile", e.Pins},
			[2]string{"HostKeyAlias", e.Alias}, [2]string{"LogLevel", "ERROR"})
	} else {
		// A shim that reports no host key (dstack's, an old one): the path
		// is authenticated up to the host (local, or the checked jump).
		opts = append(opts, [2]string{"StrictHostKeyChecking", "no"}, [2]string{"UserKnownHostsFile", "/dev/null"}, [2]string{"LogLevel", "ERROR"})
	}
	switch {
	case e.Identity != "":
		opts = append(opts, [2]string{"IdentityFile", e.Identity}, [2]string{"IdentitiesOnly", "yes"})
	case e.HomeIdentity != "":
		opts = append(opts, [2]string{"IdentityFile", e.HomeIdentity})
	}
	if e.Jump != "" {
		if e.KnownHosts == "" && e.Identity == "" {
			opts = append(opts, [2]string{"ProxyJump", e.Jump})
		} else {
			// -J passes no options to the hop: a ProxyCommand carries the
			// jump host's known_hosts file and key.
			login, hostport := "", e.Jump
			if i := strings.LastIndex(e.Jump, "@"); i >= 0 {
				login, hostport = e.Jump[:i+1], e.Jump[i+1:]
			}
			port := ""
			if h, p, err := net.SplitHostPort(hostport); err == nil {
				hostport, port = h, p
			}
			pc := []string{"ssh"}
			if e.KnownHosts != "" {
				pc = append(pc, "-o", "UserKnownHostsFile="+e.KnownHosts)
			}
			if e.Identity != "" {
				pc = append(pc, "-i", e.Identity, "-o", "IdentitiesOnly=yes")
			}
			if port != "" {
				pc = append(pc, "-p", port)
			}
			pc = append(pc, "-W", "%h:%p", login+hostport)
			quoted := make([]string, len(pc))
			for i, a := range pc {
				quoted[i] = shellQuote(a)
			}
			opts = append(opts, [2]string{"ProxyCommand", strings.Join(quoted, " ")})
		}
	}
	return opts
}

// Endpoint returns the task's SSH endpoint: on the shim's host, through
// the SSH host of c's config when there is one.
func (c *Client) Endpoint(info api.TaskInfoResponse, o SSHOptions) (SSHEndpoint, error) {
	host, err := hostOf(c.cfg.Shim)
	if err != nil {
		return SSHEndpoint{}, err
	}
	port, err := RunnerSSHPort(info, c.cfg.Ports.SSH)
	if err != nil {
		return SSHEndpoint{}, err
	}
	user := o.User
	if user == "" {
		user = "root"
	}
	route := c.cfg.SSH
	ep := SSHEndpoint{Host: host, Port: port, User: user, Identity: route.Identity, Jump: route.Target, KnownHosts: route.KnownHosts}
	if route.Identity == "" {
		ep.HomeIdentity = homeIdentity(os.UserHomeDir, accountHome)
	}
	if d := info.Tandem; o.PinDir != "" && d != nil && len(d.HostKeys) > 0 {
		ep.Alias = "tandem-task-" + info.ID
		if ep.Pins, err = sshconfig.WritePins(o.PinDir, info.ID, ep.Alias, d.HostKeys); err != nil {
			return SSHEndpoint{}, fmt.Errorf("pin the task's host keys: %w", err)
		}
	}
	return ep, nil
}

// homeIdentity is the key DefaultPublicKey finds under $HOME, as ssh
// names it (the private key file, else the public one: ssh then signs with
// the agent's key), when $HOME is not the account's home, where OpenSSH
// looks; "" otherwise.
func homeIdentity(home func() (string, error), account func() string) string {
	h, err := home()
	if err != nil || h == "" {
		return ""
	}
	if a := account(); a == "" || filepath.Clean(a) == filepath.Clean(h) {
		return ""
	}
	_, pub := defaultPublicKeyIn(h)
	if pub == "" {
		return ""
	}
	if priv := strings.TrimSuffix(pub, ".pub"); fileExists(priv) {
		return priv
	}
	return pub
}

// accountHome is the current account's home as the password database
// says (where OpenSSH looks for ~/.ssh); "" when unknown.
func accountHome() string {
	u, err := user.Current()
	if err != nil {
		return ""
	}
	return u.HomeDir
}

func fileExists(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular()
}

// runningEndpoint resolves ref to a running task and returns its SSH
// endpoint; verb names the command in the refusal of a task that is not
// running.
func (c *Client) runningEndpoint(ctx context.Context, ref string, o SSHOptions, verb string) (SSHEndpoint, error) {
	info, err := c.Resolve(ctx, ref)
	if err != nil {
		return SSHEndpoint{}, err
	}
	if info.Status != api.TaskRunning {
		return SSHEndpoint{}, fmt.Errorf("task %s is %s; %s needs a running task", DisplayName(info), info.Status, verb)
	}
	return c.Endpoint(info, o)
}

// optionArgs are Options as OpenSSH client arguments (-o Key=value).
func (e SSHEndpoint) optionArgs() []string {
	var args []string
	for _, kv := range e.Options() {
		args = append(args, "-o", kv[0]+"="+kv[1])
	}
	return args
}

// SSHCommand returns the OpenSSH client argv that opens a shell (or runs
// command) in the task's container through the runner's SSH server; tty
// asks for a terminal even with a command (ssh -tt, docker exec -t).
func (c *Client) SSHCommand(ctx context.Context, ref string, o SSHOptions, command []string, tty bool) ([]string, error) {
	ep, err := c.runningEndpoint(ctx, ref, o, "ssh")
	if err != nil {
		return nil, err
	}
	argv := append([]string{"ssh"}, ep.optionArgs()...)
	if tty {
		argv = append(argv, "-tt")
	}
	argv = append(argv, ep.User+"@"+ep.Host)
	if len(command) == 0 {
		return argv, nil
	}
	// ssh reads options after the destination too: "--" ends them, so a
	// command line starting with "-" is the command's.
	return append(append(argv, "--"), command...), nil
}

// RemoteCommand is the command line an SSH server's shell reads for
// words, each word quoted so that the job's program gets them as they
// are, as docker exec passes its argv: ssh itself joins its words with
// spaces, and `sh -c 'exit 5'` reached the shell as `sh -c exit 5` (exit
// status 0). With shellLine, a single word is taken as a command line of
// its own (`'make && make test'`), as ssh reads one; several words are
// always argv.
func RemoteCommand(words []string, shellLine bool) []string {
	if len(words) > 0 && words[0] == "--" { // the CLI's end of flags
		words = words[1:]
	}
	if len(words) == 0 {
		return nil
	}
	if shellLine && len(words) == 1 {
		return words
	}
	quoted := make([]string, len(words))
	for i, w := range words {
		quoted[i] = shellQuote(w)
	}
	return []string{strings.Join(quoted, " ")}
}

// SSHConfigEntry renders one Host block for a task, marked with the task
// and shim it belongs to so that tandem can replace or drop it later. The
// alias and id come from the shim's answer: both must pass the shim's own
// id rules (letters, digits, . _ -), so that no answer can add lines (a
// ProxyCommand) to the user's ssh config.
func SSHConfigEntry(alias, taskID, shim string, ep SSHEndpoint) (string, error) {
	if err := ident.TaskID(taskID); err != nil {
		return "", fmt.Errorf("ssh config entry: %w", err)
	}
	if err := ident.TaskName(alias); err != nil {
		return "", fmt.Errorf("ssh config entry: %w", err)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s\nHost %s\n", sshconfig.Marker(taskID, shim), alias)
	for _, kv := range ep.Options() {
		v := kv[1]
		if strings.ContainsAny(v, " \t") && kv[0] != "ProxyCommand" {
			v = `"` + v + `"`
		}
		fmt.Fprintf(&b, "  %s %s\n", kv[0], v)
	}
	return b.String(), nil
}

// CopyTarget splits one argument of tandem cp: TASK:PATH names a path in
// a task's container, anything else a local path. As docker cp reads its
// arguments, a path that starts with / or . is local whatever colons it
// holds (./a:b), and so is one whose part before the colon cannot be a
// task's name or id.
func CopyTarget(arg string) (task, path string, remote bool) {
	if arg == "" || strings.HasPrefix(arg, "/") || strings.HasPrefix(arg, ".") {
		return "", arg, false
	}
	task, path, ok := strings.Cut(arg, ":")
	if !ok || task == "" || (ident.TaskName(task) != nil && ident.TaskID(task) != nil) {
		return "", arg, false
	}
	return task, path, true
}

// CopyCommand returns the OpenSSH client argv of tandem cp SRC DST: scp
// (SCPCommand), or, when one side is "-", ssh running tar in the container
// (TarStreamCommand), as docker cp reads "-".
func (c *Client) CopyCommand(ctx context.Context, o SSHOptions, src, dst string) ([]string, error) {
	if src == "-" || dst == "-" {
		return c.TarStreamCommand(ctx, o, src, dst)
	}
	return c.SCPCommand(ctx, o, src, dst)
}

// TarStreamCommand returns the OpenSSH ssh argv that copies between a tar
// stream on this side ("-": stdin or stdout) and TASK:PATH, as docker cp
// does: TASK:PATH - writes a tar of PATH (a file or a directory, under its
// own name) to stdout; - TASK:DIR extracts a tar from stdin into the
// directory DIR. tar runs in the container as the login (an image with no
// tar is told so, exit 127); what it extracts is the user's own stream into
// the user's own container.
func (c *Client) TarStreamCommand(ctx context.Context, o SSHOptions, src, dst string) ([]string, error) {
	if src == "-" && dst == "-" {
		return nil, fmt.Errorf("- is a tar stream on this side: the other side must be TASK:PATH")
	}
	other := src
	if src == "-" {
		other = dst
	}
	ref, rpath, remote := CopyTarget(other)
	if !remote {
		return nil, fmt.Errorf("tandem cp copies between this machine and one task: with -, give the other side as TASK:PATH (got %q)", other)
	}
	var script string
	if src == "-" {
		dir := rpath
		if dir == "" {
			dir = "."
		}
		script = "exec tar -x -f - -C " + shellQuote(dir)
	} else {
		if rpath == "" {
			rpath = "."
		}
		clean := path.Clean(rpath)
		dir, base := path.Dir(clean), path.Base(clean)
		if clean == "/" {
			base = "."
		}
		script = "exec tar -c -f - -C " + shellQuote(dir) + " -- " + shellQuote(base)
	}
	ep, err := c.runningEndpoint(ctx, ref, o, "cp")
	if err != nil {
		return nil, err
	}
	script = "command -v tar >/dev/null 2>&1 || { echo 'tandem cp: the container has no tar, which a copy with - runs: copy with a path instead' >&2; exit 127; }; " + script
	// No terminal (-T): the stream is binary, and a pty would rewrite it.
	// sh reads the script whatever the login's shell is (fish, csh).
	argv := append([]string{"ssh", "-T"}, ep.optionArgs()...)
	return append(argv, "--", ep.User+"@"+ep.Host, "sh -c "+shellQuote(script)), nil
}

// SCPCommand returns the OpenSSH scp argv that copies src to dst, one of
// them TASK:PATH in a running task's container, through the runner's SSH
// server with the same endpoint as tandem ssh (its pinned host key, the
// jump host). Modes and times are kept (-p), and directories are copied whole.
// An empty PATH is the login's home, as scp reads host:.
func (c *Client) SCPCommand(ctx context.Context, o SSHOptions, src, dst string) ([]string, error) {
	st, sp, sRemote := CopyTarget(src)
	dt, dp, dRemote := CopyTarget(dst)
	if sRemote == dRemote {
		return nil, fmt.Errorf("tandem cp copies between this machine and one task: give exactly one side as TASK:PATH (got %q and %q)", src, dst)
	}
	ref, rpath := st, sp
	if dRemote {
		ref, rpath = dt, dp
	}
	ep, err := c.runningEndpoint(ctx, ref, o, "cp")
	if err != nil {
		return nil, err
	}
	// -r always: a directory is copied whole, as docker cp copies one
	// (scp -r copies a file as plain scp does, so nothing changes for one).
	argv := []string{"scp", "-p", "-r"}
	argv = append(argv, ep.optionArgs()...)
	host := ep.Host
	if strings.Contains(host, ":") {
		host = "[" + host + "]"
	}
	remote := ep.User + "@" + host + ":" + rpath
	// "--" ends scp's options: a local path that starts with "-" is a path.
	if sRemote {
		return append(argv, "--", remote, localForSCP(dp)), nil
	}
	return append(argv, "--", localForSCP(sp), remote), nil
}

// localForSCP keeps scp from reading a local path as host:path: scp takes
// a colon before any slash for a remote one, so such a path gets "./".
func localForSCP(p string) string {
	if i := strings.IndexByte(p, ':'); i >= 0 && !strings.Contains(p[:i], "/") {
		return "./" + p
	}
	return p
}
