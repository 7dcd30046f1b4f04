package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/ctl"
)

var runnerPortFlag = &cli.IntFlag{Name: "runner-port", Usage: "the runner's HTTP port on the host (default: as the shim reports)"}

func runCmd() *cli.Command {
	return &cli.Command{
		Name:      "run",
		Usage:     "run a command as a job on the shim's machine",
		ArgsUsage: "[IMAGE] COMMAND [ARGS...]  (as docker run; or --image IMAGE, or -- COMMAND for the default image)",
		Description: `Exit status: the job's (128+N when a signal N killed it, 137 with "out of memory"
when the container's memory limit did), 125 when tandem could not run it (shim
unreachable, image pull failed, bad flags), 126/127 when the command cannot run
or is not found, 124 when --max-duration ended it, 130 when Ctrl-C (or SIGTERM)
ended the run, 143 when someone else stopped the task.

Multi-node (--nodes N): one job per host, as dstack runs a multi-node task: host
networking, the same commands on every node, node 0 (the first --ssh or --shim)
the master. Each node gets DSTACK_NODE_RANK, DSTACK_NODES_IPS,
DSTACK_MASTER_NODE_IP, the MPI hostfile $DSTACK_MPI_HOSTFILE and an SSH key
that reaches every other node's runner (ssh <node ip>, mpirun, torchrun).
The nodes' addresses are found on the network they share (--node-ip to give
them). The run ends with the master's job and exits with its status; a worker
that fails or dies first fails the run (with its exit status, 125 when it died
without one) and every node is stopped. The master's output is shown as is,
the workers' with a [node N] prefix on stderr.

  tandem run --nodes 2 --ssh root@10.0.0.5 --ssh root@10.0.0.6 --image my/mpi -- \
    sh -c 'if [ $DSTACK_NODE_RANK = 0 ]; then mpirun -np 2 --hostfile $DSTACK_MPI_HOSTFILE hostname; else sleep infinity; fi'`,
		Flags: slices.Concat(runConnFlags(), []cli.Flag{
			runnerPortFlag,
			&cli.IntFlag{Name: "nodes", Value: 1, Usage: "hosts to run the job on (one --ssh or --shim each; node 0 is the master)"},
			&cli.StringSliceFlag{Name: "node-ip", Usage: "with --nodes: each node's address on the network the nodes share, in node order (default: found from the shims)"},
			&cli.StringFlag{Name: "image", Value: "ubuntu:22.04", Usage: "container image"},
			&cli.StringFlag{Name: "registry-username", EnvVars: []string{"TANDEM_REGISTRY_USERNAME"}, Usage: "registry login for the image"},
			&cli.StringFlag{Name: "registry-password", EnvVars: []string{"TANDEM_REGISTRY_PASSWORD"}, Usage: "registry password or token (prefer the env var: argv is visible to other users)"},
			&cli.StringFlag{Name: "name", Usage: "task name (default: tandem-<id>)"},
			&cli.BoolFlag{Name: "detach", Aliases: []string{"d"}, Usage: "print the task's name and id once the job runs, and exit (tandem attach, logs, rm)"},
			&cli.BoolFlag{Name: "interactive", Aliases: []string{"i"}, Usage: "the job reads tandem's stdin (a pipe, a file, or lines typed here, sent line by line; its end too), as docker run -i; with -t, keys as typed; without it the job's stdin ends at once"},
			&cli.BoolFlag{Name: "tty", Aliases: []string{"t"}, Usage: "the job's terminal takes this terminal's size (24x80 when neither stdout nor stdin is one) and follows its resizes, as docker run -t; with -i (stdin must be a terminal) this terminal is raw while the job runs: keys go to the job as typed, Ctrl-C is the job's; with --nodes, node 0's terminal only; without -i the job's stdin still ends at once"},
			&cli.BoolFlag{Name: "quiet", Aliases: []string{"q"}, Usage: "no status lines (they are also left out when stderr is not a terminal; warnings and errors stay)"},
			&cli.StringFlag{Name: "user", Aliases: []string{"u"}, Usage: "run the job as USER[:GROUP] (names or ids), as docker run -u (default: the image's)"},
			&cli.StringFlag{Name: "entrypoint", Usage: "run this program with the command's words as its arguments, as docker run --entrypoint"},
			&cli.BoolFlag{Name: "privileged", Usage: "run the container privileged (every capability and device), as docker run --privileged"},
			&cli.StringFlag{Name: "gpus", Value: "0", Usage: "GPUs: a count, or all"},
			&cli.Float64Flag{Name: "cpu", Aliases: []string{"cpus"}, Usage: "CPU limit in cores (0: none)"},
			&cli.StringFlag{Name: "memory", Aliases: []string{"m"}, Usage: "memory limit, e.g. 8GiB"},
			&cli.StringFlag{Name: "shm-size", Usage: "/dev/shm size, e.g. 1GiB"},
			&cli.Int64Flag{Name: "pids-limit", Usage: "the job's processes and threads at most (default: the shim's)"},
			&cli.StringFlag{Name: "workdir", Aliases: []string{"w"}, Value: "/workflow", Usage: "working dir in the container"},
			&cli.StringFlag{Name: "code", Usage: "local directory uploaded into the working dir"},
			&cli.StringFlag{Name: "code-limit", Value: "256MiB", Usage: "the largest --code archive to send, checked before anything is made: the runner's --max-upload-bytes (0: no check)"},
			&cli.StringSliceFlag{Name: "publish", Aliases: []string{"p"}, Usage: "publish a job port on the host, as docker run -p: [HOST_IP:][HOST_PORT:]CONTAINER_PORT[/tcp|udp] (bridge network; without HOST_IP every address of the host; without HOST_PORT one Docker picks: docker port on the host shows it); a Tandem shim only"},
			&cli.StringFlag{Name: "network", Aliases: []string{"net"}, Usage: "bridge or host (default: bridge, as docker run, so that many jobs run at once; host with --nodes N or --runner-port)"},
			&cli.DurationFlag{Name: "max-duration", Usage: "stop the job after this long (exit status 124)"},
			&cli.BoolFlag{Name: "rm", Usage: "remove the task when the run ends (default: it is kept, stopped, with its output and exit status, until tandem rm or prune, as docker run)"},
			&cli.BoolFlag{Name: "no-ssh-config", Usage: "do not add the task to tandem's SSH config (tandem ssh-config)"},
			outputFlag,
		},
			// Two flags rather than an alias: urfave refuses both forms of
			// one flag in a command line, and people mix them.
			wholeFlags("KEY=VALUE, or KEY for this machine's value, as docker run (repeatable; --env and -e are one list)", "env", "e"),
			wholeFlags("HOSTPATH:PATH[:ro], a host path that exists (repeatable; -v, --volume and --mount are one list; docker's type=bind,source=...,target=...[,readonly] too)", "mount", "volume", "v"),
			wholeFlags("public key allowed into the container for tandem ssh (repeatable; default: yours)", "authorized-key"),
		),
		Action: runAction,
	}
}

func runAction(c *cli.Context) error {
	image, cmd := runImage(c)
	if len(cmd) == 0 && !c.IsSet("image") && c.NArg() == 0 {
		return exitError{ctl.ExitFailure, "no image: tandem run [flags] IMAGE [COMMAND [ARGS...]] (with no command, the image's own ENTRYPOINT and CMD)"}
	}
	// --entrypoint replaces the image's ENTRYPOINT: the command's words
	// become its arguments, as docker run's.
	if ep := c.String("entrypoint"); ep != "" {
		cmd = append([]string{ep}, cmd...)
	}
	// -it reads keys from a terminal, as docker's, which says this (and
	// exits 1) before anything is made.
	if c.Bool("tty") && c.Bool("interactive") && !inputIsTerminal(stdinOf(c)) {
		fmt.Fprintln(c.App.ErrWriter, "the input device is not a TTY")
		return exitError{1, ""}
	}
	jsonOut := c.String("output") == "json"
	nodes, err := runNodes(c)
	if err != nil {
		return err
	}
	o, err := runOptions(c, cmd, nodes[0].shim, jsonOut)
	if err != nil {
		return err
	}
	progress := runProgress(c, jsonOut)
	if len(cmd) == 0 && !c.IsSet("workdir") {
		o.WorkDir = "" // the image's WORKDIR, as its command's
	}
	if c.Bool("rm") && o.Detach {
		return exitError{ctl.ExitFailure, "--rm and -d do not go together here: nothing is left to remove a detached task when its job ends; remove it with tandem rm (or tandem prune)"}
	}
	if o.Stdin != nil && len(nodes) > 1 {
		return exitError{ctl.ExitFailure, "--interactive takes one node: of a multi-node run's jobs, none would be the one to read it"}
	}
	o.Image = image
	// The run's client is node 0's; a multi-node run's other nodes are
	// reached with its config, each over its own tunnel.
	var master *ctl.Client
	var cluster []ctl.Node
	for i := range nodes {
		cfg, closeDial, err := config(c, nodes[i].shim, nodes[i].ssh)
		if err != nil {
			return err
		}
		defer closeDial()
		if i == 0 {
			cfg.Progress, cfg.SSH.Identity = progress, entryIdentity(c)
			if master, err = newClient(cfg); err != nil {
				return err
			}
		}
		label, target := nodes[i].shim, hostPart(nodes[i].shim)
		if nodes[i].ssh != "" {
			label = nodes[i].ssh
			_, target, _ = strings.Cut(nodes[i].ssh, "@")
			target = hostPart(target)
		}
		cluster = append(cluster, ctl.Node{Shim: nodes[i].shim, Dial: cfg.Dial, Label: label, IP: nodes[i].ip, Target: targetIP(target)})
	}
	if !c.Bool("no-ssh-config") {
		o.Started = func(info api.TaskInfoResponse) {
			if err := updateSSHConfig(master, info); err != nil {
				fmt.Fprintln(c.App.ErrWriter, "tandem: warning: ssh config:", err)
			}
		}
	}
	var tty *runTerminal
	if c.Bool("tty") {
		tty = newRunTerminal(stdinOf(c), c.App.Writer, c.Bool("interactive"))
		size := tty.size()
		o.TTY = &size
		if !o.Detach {
			var stopFollow func()
			o.Resizes, stopFollow = tty.follow()
			defer stopFollow()
		}
		// Raw from the job's start (the status lines before it keep their
		// line ends) to the run's end, whichever way it ends.
		defer tty.restore()
		started := o.Started
		o.Started = func(info api.TaskInfoResponse) {
			if started != nil {
				started(info)
			}
			tty.makeRaw()
		}
	}
	var run interface {
		Execute(context.Context) (ctl.Result, error)
		Stop()
	}
	if len(cluster) > 1 {
		run, err = ctl.NewCluster(master, o, cluster)
	} else {
		run, err = ctl.NewRun(master, o)
	}
	if err != nil {
		return exitError{ctl.ExitFailure, errText(err)}
	}
	// The first Ctrl-C stops the run gracefully, the second ends it now.
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	stopSignals := onSignals(run.Stop, func() { cancel(ctl.ErrInterrupted) })
	res, err := run.Execute(ctx)
	stopSignals()
	tty.restore() // before the run's last lines
	return reportRun(c, o, res, err, jsonOut)
}

// runImage splits the arguments as docker run does, IMAGE then COMMAND,
// unless --image names the image or every argument follows `--` (tandem's
// older `run [flags] -- COMMAND`, on the default image).
func runImage(c *cli.Context) (string, []string) {
	args := c.Args().Slice()
	if c.IsSet("image") || len(args) == 0 {
		return c.String("image"), args
	}
	argv, _ := c.App.Metadata[argvKey].([]string)
	if argv == nil {
		argv = os.Args
	}
	if i := slices.Index(argv, "--"); i >= 0 && len(argv)-i-1 == len(args) {
		return c.String("image"), args
	}
	return args[0], args[1:]
}

// runNetwork is the run's network: --network as given, else bridge, as
// docker run's default, so that a second and tenth run start while others
// run (a host-network task's runner holds the host's runner ports). A
// multi-node run and one given --runner-port (a host-network runner's
// port) are on the host network.
func runNetwork(c *cli.Context) string {
	switch {
	case c.IsSet("network"):
		return c.String("network")
	case c.Int("nodes") > 1 || c.IsSet("runner-port"):
		return "host"
	}
	return "bridge"
}

// runOptions is a one-node run of cmd on shim as the flags describe it.
func runOptions(c *cli.Context, cmd []string, shim string, jsonOut bool) (ctl.RunOptions, error) {
	o := ctl.RunOptions{Name: c.String("name"),
		Image: c.String("image"), RegistryUsername: c.String("registry-username"), RegistryPassword: c.String("registry-password"), CPU: c.Float64("cpu"), WorkDir: c.String("workdir"), CodeDir: c.String("code"),
		Network: runNetwork(c), MaxDuration: c.Duration("max-duration"), Commands: cmd, Detach: c.Bool("detach"), Keep: !c.Bool("rm"),
		Env: map[string]string{}}
	if c.Bool("interactive") {
		o.Stdin = stdinOf(c)
	}
	workers := terminalSafe(c.App.ErrWriter) // before shareLines wraps it
	if jsonOut {
		// Only JSON on stdout: the job's output goes to stderr, and of the
		// progress only what the user must read.
		o.Out = shareLines(c, ctl.LineEnds(terminalSafe(c.App.ErrWriter)), true)
	} else {
		o.Out = shareLines(c, jobOutput(c), sameStream(c))
	}
	o.Workers = workers
	bad := func(msg string) error { return exitError{ctl.ExitFailure, msg} }
	if err := runLimits(c, &o); err != nil {
		return o, bad(err.Error())
	}
	if err := parseEnv(wholeValues(c, "env"), o.Env, os.LookupEnv); err != nil {
		return o, bad(err.Error())
	}
	for _, v := range wholeValues(c, "mount") {
		m, err := parseMount(v)
		if err != nil {
			return o, bad(err.Error())
		}
		o.Mounts = append(o.Mounts, m)
	}
	o.User, o.Privileged = c.String("user"), c.Bool("privileged")
	if len(c.StringSlice("ssh")) == 0 && isLoopback(hostPart(shim)) {
		// The shim's host is this one: a missing mount path is said here,
		// in one line, before anything is sent (the shim refuses it too).
		for _, m := range o.Mounts {
			if _, err := os.Stat(m.InstancePath); errors.Is(err, os.ErrNotExist) {
				return o, bad(fmt.Sprintf("mount %s:%s: %s does not exist; a mount's host path is never created: make it first (mkdir -p %s)", m.InstancePath, m.Path, m.InstancePath, m.InstancePath))
			}
		}
	}
	if o.CodeDir != "" {
		if fi, err := os.Stat(o.CodeDir); err != nil || !fi.IsDir() {
			return o, bad(fmt.Sprintf("--code %s: not a directory", o.CodeDir))
		}
	}
	if o.Network != "host" && o.Network != "bridge" {
		return o, bad("--network must be host or bridge")
	}
	for _, spec := range c.StringSlice("publish") {
		p, err := parsePublish(spec)
		if err != nil {
			return o, bad(err.Error())
		}
		o.Publish = append(o.Publish, p)
	}
	if len(o.Publish) > 0 && o.Network != "bridge" {
		why := "drop --network host"
		switch {
		case c.Int("nodes") > 1:
			why = "a multi-node run is on the host network"
		case c.IsSet("runner-port"):
			why = "--runner-port puts the job on the host network"
		}
		return o, bad("--publish needs the bridge network, as a host-network job's ports are the host's already: " + why)
	}
	o.SSHKeys = wholeValues(c, "authorized-key")
	identity := c.String("identity")
	if len(o.SSHKeys) == 0 {
		if k, _ := ctl.DefaultPublicKey(identity); k != "" {
			o.SSHKeys = []string{k}
		} else if o.Detach && !c.Bool("quiet") {
			// Said where tandem ssh is how one gets back in: a run that
			// is watched to its end (make demo's) is not told about a key
			// it does not use.
			fmt.Fprintln(c.App.ErrWriter, "tandem: warning: no SSH public key found (~/.ssh/id_ed25519.pub or id_rsa.pub), so tandem ssh into this task will not work;"+
				" create one with `ssh-keygen -t ed25519` or pass --authorized-key")
		}
	}
	return o, nil
}

// stdinOf is tandem's stdin.
func stdinOf(c *cli.Context) io.Reader {
	if c.App.Reader != nil {
		return c.App.Reader
	}
	return os.Stdin
}

// runLimits reads the run's limits (GPUs, memory, /dev/shm, the code
// archive, processes, duration, CPU) into o, refusing a bad one here,
// not as "none" (a negative duration) or as the shim's 400 once the run
// began.
func runLimits(c *cli.Context, o *ctl.RunOptions) error {
	var err error
	if o.GPUs, err = parseGPUs(c.String("gpus")); err != nil {
		return err
	}
	if o.Memory, err = parseSize(c.String("memory")); err != nil {
		return fmt.Errorf("--memory: %w", err)
	}
	if o.ShmSize, err = parseSize(c.String("shm-size")); err != nil {
		return fmt.Errorf("--shm-size: %w", err)
	}
	if o.CodeLimit, err = parseSize(c.String("code-limit")); err != nil {
		return fmt.Errorf("--code-limit: %w", err)
	}
	if o.CodeLimit == 0 {
		o.CodeLimit = -1 // no check
	}
	if o.PidsLimit = c.Int64("pids-limit"); o.PidsLimit < 0 {
		return errors.New("--pids-limit: want a positive count")
	}
	if o.MaxDuration < 0 {
		return fmt.Errorf("--max-duration %s: want a positive duration, e.g. 30m (0: none)", o.MaxDuration)
	}
	if c.Float64("cpu") < 0 {
		return fmt.Errorf("--cpu %g: want a positive count of cores, e.g. 1.5 (0: no limit)", c.Float64("cpu"))
	}
	return nil
}

// runProgress is where a run's events are shown. Status lines are for a
// person watching: left out with -q, -o json, and where stderr is not a
// terminal (a log file, CI), as docker's progress is.
func runProgress(c *cli.Context, jsonOut bool) func(ctl.Event) {
	quiet := jsonOut || c.Bool("quiet") || !isTerminal(c.App.ErrWriter)
	return (&progressPrinter{w: c.App.ErrWriter, tty: isTerminal(os.Stderr) && !jsonOut, quiet: quiet}).event
}

// parseMount reads -v/--volume/--mount: HOST:PATH[:ro|:rw], or docker's
// --mount type=bind,source=HOST,target=PATH[,readonly]. The host path must
// exist: it is never created (the shim is told so), as docker's --mount
// refuses a missing one. Where this machine is the shim's (no --ssh to
// another), a missing path is refused here, before anything is sent.
func parseMount(v string) (api.InstanceMountPoint, error) {
	m := api.InstanceMountPoint{MustExist: true}
	want := fmt.Sprintf("mount %q: want /host/path:/container/path[:ro]", v)
	if strings.Contains(v, "=") {
		for _, kv := range strings.Split(v, ",") {
			k, val, _ := strings.Cut(kv, "=")
			switch k {
			case "type":
				if val != "bind" {
					return m, fmt.Errorf("--mount %q: only type=bind (a host path) is in the shim's protocol", v)
				}
			case "source", "src":
				m.InstancePath = val
			case "target", "dst", "destination":
				m.Path = val
			case "readonly", "ro":
				m.ReadOnly = val == "" || val == "true" || val == "1"
			default:
				return m, fmt.Errorf("--mount %q: %q is not in the shim's protocol: want type=bind,source=/host/path,target=/container/path[,readonly]", v, k)
			}
		}
	} else {
		parts := strings.Split(v, ":")
		switch {
		case len(parts) == 3 && (parts[2] == "ro" || parts[2] == "rw"):
			m.ReadOnly = parts[2] == "ro"
		case len(parts) == 3:
			return m, fmt.Errorf("mount %q: option %q: want ro or rw (a path may not hold ':')", v, parts[2])
		case len(parts) != 2:
			return m, errors.New(want)
		}
		m.InstancePath, m.Path = parts[0], parts[1]
	}
	if !filepath.IsAbs(m.InstancePath) || !filepath.IsAbs(m.Path) {
		if m.InstancePath != "" && !filepath.IsAbs(m.InstancePath) && !strings.Contains(v, "=") && !strings.Contains(m.InstancePath, "/") {
			return m, fmt.Errorf("mount %q: %q is a docker named volume; the shim binds host paths only: want /host/path:/container/path[:ro]", v, m.InstancePath)
		}
		return m, errors.New(want)
	}
	return m, nil
}

// keptText says which tasks an interrupted run left stopped and how to
// read and remove them.
func keptText(res ctl.Result) string {
	names := res.KeptNames
	if len(names) == 0 {
		names = []string{res.Name}
	}
	if len(names) == 1 {
		return fmt.Sprintf("interrupted: task %s was stopped (tandem logs %s; tandem rm %s removes it)", names[0], names[0], names[0])
	}
	all := strings.Join(names, " ")
	return fmt.Sprintf("interrupted: tasks %s were stopped, one per host (tandem logs NAME with each host's --ssh or --shim; tandem rm removes them)", all)
}

// reportRun prints how the run ended (JSON with --output json) and returns
// the exit code as an error for main.
func reportRun(c *cli.Context, o ctl.RunOptions, res ctl.Result, err error, jsonOut bool) error {
	code := res.ExitCode()
	switch {
	case err == nil && res.Detached:
		code = 0 // the job was started and left running: a success
	case errors.Is(err, ctl.ErrInterrupted):
		code = ctl.ExitInterrupted
	case err != nil:
		code = ctl.ExitFailure
	}
	if !o.Detach && !c.Bool("no-ssh-config") && res.TaskID != "" {
		_ = forgetSSHConfig(res.TaskID)
	}
	if jsonOut {
		out := map[string]any{"task_id": res.TaskID, "name": res.Name, "state": res.State, "exit_status": res.ExitStatus,
			"termination_reason": res.Reason, "termination_message": res.Message, "exit_code": code, "detached": res.Detached}
		if err != nil {
			out["error"] = errText(err)
		}
		if werr := writeJSON(c, out); werr != nil {
			return werr
		}
		if code != 0 {
			return exitError{code, ""}
		}
		return nil
	}
	switch {
	case err != nil && errors.Is(err, ctl.ErrInterrupted) && res.Kept:
		return exitError{code, keptText(res)}
	case err != nil && errors.Is(err, ctl.ErrInterrupted):
		return exitError{code, "interrupted: the task was terminated and removed"}
	case err != nil:
		return exitError{code, errText(err)}
	case res.Detached:
		fmt.Fprintf(c.App.Writer, "%s\t%s\n", res.Name, res.TaskID)
		return nil
	case code != 0:
		return exitError{code, ctl.Describe(res)}
	}
	if !c.Bool("quiet") {
		fmt.Fprintln(c.App.ErrWriter, ctl.Describe(res))
	}
	return nil
}

// runConnFlags are connFlags with --shim and --ssh repeatable, one per node.
func runConnFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringSliceFlag{Name: "shim", EnvVars: []string{"TANDEM_SHIM"}, Usage: "shim address host:port (with --ssh: as seen on the host; default 127.0.0.1:10998); with --nodes, one per node or one for all"},
		&cli.StringFlag{Name: "shim-token", EnvVars: []string{"TANDEM_SHIM_API_TOKEN"}, Usage: "bearer token for a shim started with --api-token"},
		&cli.StringSliceFlag{Name: "ssh", EnvVars: []string{"TANDEM_SSH"}, Usage: "reach the host over SSH: user@host[:port]; with --nodes, one per node"},
		&cli.StringFlag{Name: "identity", Usage: "SSH private key (default ~/.ssh/id_ed25519, id_rsa; -i KEYFILE still works, deprecated: -i is docker's --interactive)"},
		&cli.StringFlag{Name: "known-hosts", Usage: "known_hosts file (default ~/.ssh/known_hosts)"},
	}
}

// runNode is where one node of a run is reached.
type runNode struct{ shim, ssh, ip string }

// runNodes pairs the --shim, --ssh and --node-ip values into --nodes nodes.
func runNodes(c *cli.Context) ([]runNode, error) {
	bad := func(format string, args ...any) error {
		return exitError{ctl.ExitFailure, fmt.Sprintf(format, args...)}
	}
	n := c.Int("nodes")
	shims, sshs, ips := c.StringSlice("shim"), c.StringSlice("ssh"), c.StringSlice("node-ip")
	if n < 1 {
		return nil, bad("--nodes %d: want 1 or more", n)
	}
	if n == 1 && (len(shims) > 1 || len(sshs) > 1) {
		return nil, bad("several --shim or --ssh hosts: give --nodes with their number")
	}
	if len(ips) != 0 && len(ips) != n {
		return nil, bad("--node-ip given %d times for %d nodes: give one per node, in node order", len(ips), n)
	}
	if n > 1 && len(sshs) == 0 && len(shims) != n {
		return nil, bad("--nodes %d: give %d hosts (--ssh or --shim, one per node, the master first)", n, n)
	}
	if len(sshs) > 0 && len(sshs) != n {
		return nil, bad("--nodes %d with %d --ssh hosts: give one per node", n, len(sshs))
	}
	if len(sshs) > 0 && len(shims) > 1 && len(shims) != n {
		return nil, bad("--nodes %d with %d --shim addresses: give one for all nodes or one per node", n, len(shims))
	}
	nodes := make([]runNode, n)
	for i, v := range shims {
		a, err := shimAddr(v)
		if err != nil {
			return nil, err
		}
		shims[i] = a
	}
	for i := range nodes {
		nodes[i].shim = defaultShim
		switch {
		case len(shims) == n:
			nodes[i].shim = shims[i]
		case len(shims) == 1:
			nodes[i].shim = shims[0]
		}
		if len(sshs) > 0 {
			nodes[i].ssh = sshs[i]
		}
		if len(ips) > 0 {
			nodes[i].ip = ips[i]
		}
	}
	return nodes, nil
}

// hostPart is host of host:port, or s when it has no port.
func hostPart(s string) string {
	if h, _, err := net.SplitHostPort(s); err == nil {
		return h
	}
	return s
}

// isLoopback says whether host is this machine's loopback (localhost or a
// loopback address).
func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip, err := netip.ParseAddr(strings.Trim(host, "[]"))
	return err == nil && ip.IsLoopback()
}

// targetIP is host as an IP address when it is one, else "".
func targetIP(host string) string {
	if ip, err := netip.ParseAddr(strings.Trim(host, "[]")); err == nil {
		return ip.String()
	}
	return ""
}

func attachCmd() *cli.Command {
	return &cli.Command{
		Name:      "attach",
		Usage:     "follow a running task's job: its output from the start, then its exit status",
		ArgsUsage: "TASK (name, id or id prefix)",
		Flags: append(connFlags(), runnerPortFlag,
			&cli.DurationFlag{Name: "since", Usage: "only output newer than this, e.g. 5m (default: from the start)"}),
		BashComplete: completeTasks,
		Action: func(c *cli.Context) error {
			if c.NArg() != 1 {
				return exitError{ctl.ExitFailure, "usage: tandem attach TASK"}
			}
			// Ctrl-C detaches: the job runs on. What attach says besides
			// the job's output is a line each on stderr.
			ctx, cl, done, err := interruptible(c, (&progressPrinter{w: c.App.ErrWriter}).event)
			if err != nil {
				return err
			}
			out := shareLines(c, jobOutput(c), sameStream(c))
			res, err := cl.Attach(ctx, c.Args().First(), sinceFlag(c), out)
			done()
			if err != nil {
				return exitError{ctl.ExitFailure, errText(err)}
			}
			if res.Detached {
				name := res.Name
				if name == "" {
					name = ctl.ShortID(res.TaskID)
				}
				fmt.Fprintf(c.App.ErrWriter, "detached; the job runs on (tandem attach %s, tandem stop %s)\n", name, name)
				return exitError{ctl.ExitInterrupted, ""}
			}
			if code := res.ExitCode(); code != 0 {
				return exitError{code, ctl.Describe(res)}
			}
			fmt.Fprintln(c.App.ErrWriter, ctl.Describe(res))
			return nil
		}}
}

// jobOutput is where a job's output goes: as the job wrote it on a
// terminal (less what would make the terminal answer: ctl.TerminalSafe),
// with "\n" line ends anywhere else.
func jobOutput(c *cli.Context) io.Writer {
	if isTerminal(c.App.Writer) {
		return ctl.TerminalSafe(c.App.Writer)
	}
	return ctl.LineEnds(c.App.Writer)
}

// terminalSafe is w for a job's output: on a terminal without the
// sequences that make it answer (ctl.TerminalSafe), else w itself.
func terminalSafe(w io.Writer) io.Writer {
	if isTerminal(w) {
		return ctl.TerminalSafe(w)
	}
	return w
}
