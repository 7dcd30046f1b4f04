package cli

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/ctl"
)

var runnerSSHPortFlag = &cli.IntFlag{Name: "runner-ssh-port", Usage: "the runner's SSH port on the host (default: as the shim reports)"}

// psRow is one task as ps shows it.
type psRow struct {
	Name       string         `json:"name"`
	ID         string         `json:"id"`
	Image      string         `json:"image"`
	Status     api.TaskStatus `json:"status"`
	Job        api.JobState   `json:"job_state,omitempty"`
	ExitStatus *int           `json:"exit_status,omitempty"`
	Ended      int64          `json:"ended_at,omitempty"` // the job's end, Unix seconds
	Submitted  int64          `json:"submitted_at,omitempty"`
	GPUs       []string       `json:"gpus"`
	Reason     string         `json:"termination_reason,omitempty"`
	Message    string         `json:"termination_message,omitempty"`
	// Ports are the job's published ports while it runs (run -p).
	Ports []api.PublishedPort `json:"ports"`
}

func psCmd() *cli.Command {
	return &cli.Command{Name: "ps", Usage: "list the shim's tasks (running ones; -a for all)",
		Flags: append(connFlags(), runnerPortFlag, outputFlag,
			&cli.BoolFlag{Name: "all", Aliases: []string{"a"}, Usage: "finished tasks too"}),
		Action: func(c *cli.Context) error {
			// One connection (one SSH login with --ssh) for the shim and the
			// runners.
			cl, done, err := client(c, nil)
			if err != nil {
				return err
			}
			defer done()
			infos, err := cl.Tasks(c.Context)
			if err != nil {
				return exitError{ctl.ExitFailure, errText(err)}
			}
			rows := []psRow{}
			for _, info := range infos {
				if info.Status == api.TaskTerminated && !c.Bool("all") {
					continue
				}
				r := psRow{Name: ctl.TaskName(info), ID: info.ID, Status: info.Status, GPUs: info.GPUIDs,
					Reason: string(info.TerminationReason), Message: info.TerminationMessage}
				if r.GPUs == nil {
					r.GPUs = []string{}
				}
				r.Ports = []api.PublishedPort{}
				if d := info.Tandem; d != nil {
					r.Image, r.Submitted = d.ImageName, d.SubmittedAt
					if d.Published != nil {
						r.Ports = d.Published
					}
					if j := d.Job; j != nil && j.State.Final() {
						// The shim keeps the job's end: it never goes back.
						r.Job, r.ExitStatus, r.Ended = j.State, j.ExitStatus, j.Timestamp/1000
					}
				}
				if r.Job == "" {
					if ev, ok := cl.JobStatus(c.Context, info); ok {
						r.Job, r.ExitStatus = ev.State, ev.ExitStatus
						if ev.State.Final() {
							r.Ended = ev.Timestamp / 1000
						}
					}
				}
				if !c.Bool("all") && r.Job.Final() {
					continue // the job ended; its runner waits for its output to be read
				}
				rows = append(rows, r)
			}
			slices.SortStableFunc(rows, func(a, b psRow) int { return int(b.Submitted - a.Submitted) })
			if c.String("output") == "json" {
				return writeJSON(c, rows)
			}
			var table bytes.Buffer
			w := tabwriter.NewWriter(&table, 2, 4, 2, ' ', 0)
			fmt.Fprintln(w, "NAME\tID\tIMAGE\tSTATUS\tAGE\tGPUS\tEXIT\tPORTS")
			for _, r := range rows {
				// Every string is the shim's or a runner's: escaped.
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\n", dash(api.Printable(r.Name)), api.Printable(ctl.ShortID(r.ID)), dash(api.Printable(r.Image)),
					statusText(r), age(r.Submitted), len(r.GPUs), exitText(r), portsText(r.Ports))
			}
			if err := w.Flush(); err != nil {
				return err
			}
			// The last column (PORTS) is often empty: no row ends in the
			// padding of the one before it.
			for line := range strings.Lines(table.String()) {
				fmt.Fprintln(c.App.Writer, strings.TrimRight(line, " \n"))
			}
			return nil
		}}
}

// statusText renders the task's and job's states; a state that is not
// one of the known values is shown escaped as unknown.
func statusText(r psRow) string {
	switch {
	case r.Job != "": // the runner's word on the job beats the container's
		if !knownJobState(r.Job) {
			return "job unknown (" + api.Printable(string(r.Job)) + ")"
		}
		if r.Job.Final() && r.Job != api.JobTerminated && r.ExitStatus != nil {
			s := fmt.Sprintf("exited (%d)", *r.ExitStatus)
			if r.Ended > 0 {
				s += " " + age(r.Ended) + " ago"
			}
			return s
		}
		return "job " + string(r.Job)
	case !r.Status.Valid():
		return "unknown (" + api.Printable(string(r.Status)) + ")"
	case r.Status == api.TaskTerminated && r.Reason != "":
		if !api.TerminationReason(r.Reason).Valid() {
			return "terminated (unknown: " + api.Printable(r.Reason) + ")"
		}
		return "terminated (" + r.Reason + ")"
	}
	return string(r.Status)
}

func knownJobState(s api.JobState) bool {
	switch s {
	case api.JobRunning, api.JobDone, api.JobFailed, api.JobTerminated, api.JobTerminating:
		return true
	}
	return false
}

func exitText(r psRow) string {
	if r.ExitStatus != nil {
		return fmt.Sprint(*r.ExitStatus)
	}
	return "-"
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// age renders how long ago a Unix time was, as docker does: 5s, 3m, 2h, 4d.
func age(unix int64) string {
	if unix == 0 {
		return "-"
	}
	d := time.Since(time.Unix(unix, 0))
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh", int(d.Hours()))
	}
	return fmt.Sprintf("%dd", int(d.Hours()/24))
}

func logsCmd() *cli.Command {
	return &cli.Command{Name: "logs", Usage: "print a task's output (-f: follow it)", ArgsUsage: "TASK (name, id or id prefix)",
		Flags: append(connFlags(), runnerPortFlag,
			&cli.BoolFlag{Name: "follow", Aliases: []string{"f"}, Usage: "stream the output until the job ends"},
			&cli.IntFlag{Name: "tail", Aliases: []string{"n"}, Usage: "only the last N lines (0: none; then, with -f, what follows)"},
			&cli.DurationFlag{Name: "since", Usage: "only output newer than this, e.g. 5m (a running task's: the times are its runner's)"}),
		BashComplete: completeTasks,
		Action: func(c *cli.Context) error {
			if c.NArg() != 1 {
				return exitError{ctl.ExitFailure, "usage: tandem logs TASK"}
			}
			cl, done, err := client(c, nil)
			if err != nil {
				return err
			}
			defer done()
			if c.Int("tail") < 0 {
				return exitError{ctl.ExitFailure, "--tail: want a count of lines"}
			}
			lo := ctl.LogsOptions{Follow: c.Bool("follow"), Since: sinceFlag(c), Tail: c.Int("tail"), TailSet: c.IsSet("tail")}
			if err := cl.Logs(c.Context, c.Args().First(), lo, jobOutput(c)); err != nil {
				return exitError{ctl.ExitFailure, errText(err)}
			}
			return nil
		}}
}

func sshCmd() *cli.Command {
	return &cli.Command{Name: "ssh", Usage: "open a shell (or run a command) in a task's container", ArgsUsage: "TASK [-- COMMAND...]",
		Description: "COMMAND's words reach the program as they are, as docker exec passes them:\n" +
			"  tandem ssh train -- sh -c 'echo hi; exit 3'   # exits 3\n" +
			"One word alone is a command line for the login shell, as ssh reads one ($VARS expand in the container):\n" +
			"  tandem ssh train -- 'cd /workflow && ls $HOME'",
		Flags:        taskSSHFlags(),
		BashComplete: completeTasks,
		Action: func(c *cli.Context) error {
			if c.NArg() < 1 {
				return exitError{ctl.ExitFailure, "usage: tandem ssh TASK [-- COMMAND...]"}
			}
			return sshInto(c, ctl.RemoteCommand(c.Args().Slice()[1:], true), false)
		}}
}

// execCmd is docker exec: a command in a running task's container, its
// argv kept word for word (through the runner's SSH server).
func execCmd() *cli.Command {
	return &cli.Command{Name: "exec", Usage: "run a command in a task's container, its words kept as they are (docker exec)", ArgsUsage: "TASK COMMAND [ARG...]",
		Flags: append(taskSSHFlagsAs(nil),
			&cli.BoolFlag{Name: "tty", Aliases: []string{"t"}, Usage: "give the command a terminal (docker exec -t)"},
			&cli.BoolFlag{Name: "interactive", Aliases: []string{"i"}, Usage: "accepted as docker exec -i: the command always reads this stdin (the SSH key is --identity)"}),
		BashComplete: completeTasks,
		Action: func(c *cli.Context) error {
			if c.NArg() < 2 {
				return exitError{ctl.ExitFailure, "usage: tandem exec TASK COMMAND [ARG...] (a shell: tandem ssh TASK)"}
			}
			return sshInto(c, ctl.RemoteCommand(c.Args().Slice()[1:], false), c.Bool("tty"))
		}}
}

// sshInto runs OpenSSH into the task named by the first argument with the
// remote command line given.
func sshInto(c *cli.Context, remote []string, tty bool) error {
	cl, o, done, err := taskSSHOptions(c)
	if err != nil {
		return err
	}
	argv, err := cl.SSHCommand(c.Context, c.Args().First(), o, remote, tty)
	done()
	if err != nil {
		return exitError{ctl.ExitFailure, errText(err)}
	}
	return runOpenSSH(c, argv)
}

func cpCmd() *cli.Command {
	return &cli.Command{Name: "cp", Usage: "copy files between this machine and a task's container (TASK:PATH on one side, as docker cp)",
		ArgsUsage: "SRC DST",
		Description: "One of SRC and DST is TASK:PATH (a relative PATH is from the login's home). It runs OpenSSH's scp through the\n" +
			"runner's SSH server, the way tandem ssh connects (the task's pinned host key, --ssh as the jump host);\n" +
			"modes and times are kept; a directory is copied with all it holds, as docker cp copies one (-r is\n" +
			"accepted, as scp takes it, and changes nothing). A link is copied as what it points to, as scp does\n" +
			"(docker cp keeps it a link). - on one side is a tar stream, as docker cp reads it: TASK:PATH - writes a\n" +
			"tar of PATH to stdout, - TASK:DIR extracts one from stdin into DIR (tar runs in the container).\n" +
			"Examples:\n  tandem cp ./data train:/workflow/data\n  tandem cp train:/workflow/checkpoints ./ckpt\n" +
			"  tandem cp train:/workflow/checkpoints - | tar -x -C ./ckpt",
		Flags: append(taskSSHFlags(), &cli.BoolFlag{Name: "recursive", Aliases: []string{"r"},
			Usage: "copy directories (they always are, as docker cp; accepted for scp habits)"}),
		BashComplete: completeTasks,
		Action: func(c *cli.Context) error {
			if c.NArg() != 2 {
				return exitError{ctl.ExitFailure, "usage: tandem cp SRC DST (one of them TASK:PATH)"}
			}
			if c.Args().Get(1) == "-" && isTerminal(c.App.Writer) {
				// A tar holds the container's bytes as they are: escape
				// sequences a job wrote would drive this terminal.
				return exitError{ctl.ExitFailure, "refusing to write a tar stream to a terminal: pipe it (| tar -x) or redirect it to a file"}
			}
			cl, o, done, err := taskSSHOptions(c)
			if err != nil {
				return err
			}
			argv, err := cl.CopyCommand(c.Context, o, c.Args().Get(0), c.Args().Get(1))
			done()
			if err != nil {
				return exitError{ctl.ExitFailure, errText(err)}
			}
			return runOpenSSH(c, argv)
		}}
}

// taskSSHFlags are the flags of the commands that reach a task's SSH
// server (ssh, cp).
func taskSSHFlags() []cli.Flag { return taskSSHFlagsAs([]string{"i"}) }

// taskSSHFlagsAs is taskSSHFlags with --identity's aliases given.
func taskSSHFlagsAs(identityAliases []string) []cli.Flag {
	return append(connFlagsAs(identityAliases), runnerSSHPortFlag,
		&cli.StringFlag{Name: "user", Aliases: []string{"u"}, Value: "root", Usage: "login in the container"})
}

// taskSSHOptions reads taskSSHFlags: the command's client and the login;
// done ends the shim connection (over --ssh, its tunnel) once the task is
// resolved.
func taskSSHOptions(c *cli.Context) (cl *ctl.Client, o ctl.SSHOptions, done func(), err error) {
	cl, done, err = client(c, nil)
	if err != nil {
		return nil, ctl.SSHOptions{}, nil, err
	}
	pins := ""
	if f, err := sshConfig(); err == nil {
		pins = f.PinDir()
	}
	return cl, ctl.SSHOptions{User: c.String("user"), PinDir: pins}, done, nil
}

// runOpenSSH runs an OpenSSH client argv (ssh, scp) on this terminal and
// exits with its status.
func runOpenSSH(c *cli.Context, argv []string) error {
	bin, err := exec.LookPath(argv[0])
	if err != nil {
		return exitError{ctl.ExitFailure, "the OpenSSH client (" + argv[0] + ") is not installed"}
	}
	cmd := exec.Command(bin, argv[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, c.App.Writer, c.App.ErrWriter
	if err := cmd.Run(); err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return exitError{ee.ExitCode(), ""}
		}
		return exitError{ctl.ExitFailure, errText(err)}
	}
	return nil
}

// removeTasks resolves each ref and removes it; errors are reported per
// task, and any makes the command fail.
func removeTasks(c *cli.Context, refs []string, force bool, timeout uint, verb string) error {
	return eachTask(c, refs, verb, true, func(cl *ctl.Client, info api.TaskInfoResponse) error {
		return cl.Remove(c.Context, info, force, timeout)
	})
}

// eachTask resolves each ref and does act on it; errors are reported per
// task, and any makes the command fail. removed: the task is gone (its
// SSH config entry goes too).
func eachTask(c *cli.Context, refs []string, verb string, removed bool, act func(*ctl.Client, api.TaskInfoResponse) error) error {
	cl, done, err := client(c, nil)
	if err != nil {
		return err
	}
	defer done()
	var failed []string
	for _, ref := range refs {
		info, err := cl.Resolve(c.Context, ref)
		if err == nil {
			err = act(cl, info)
		}
		if err != nil {
			fmt.Fprintln(c.App.ErrWriter, "tandem:", errText(err))
			failed = append(failed, ref)
			continue
		}
		if removed {
			_ = forgetSSHConfig(info.ID)
		}
		fmt.Fprintf(c.App.Writer, "%s\t%s\t%s\n", verb, dash(ctl.TaskName(info)), info.ID)
	}
	if len(failed) > 0 {
		return exitError{ctl.ExitFailure, ""}
	}
	return nil
}

func stopCmd() *cli.Command {
	return &cli.Command{Name: "stop", Usage: "stop tasks' jobs and keep the tasks (their output, exit status, ps -a row) until tandem rm or prune, as docker stop",
		ArgsUsage: "TASK... (name, id or id prefix)", Flags: append(connFlags(),
			&cli.UintFlag{Name: "timeout", Aliases: []string{"t"}, Value: 10, Usage: "seconds of graceful stop, then a kill"}),
		BashComplete: completeTasks,
		Action: func(c *cli.Context) error {
			if c.NArg() < 1 {
				return exitError{ctl.ExitFailure, "usage: tandem stop TASK..."}
			}
			return eachTask(c, c.Args().Slice(), "stopped", false, func(cl *ctl.Client, info api.TaskInfoResponse) error {
				return cl.StopTask(c.Context, info, c.Uint("timeout"))
			})
		}}
}

func rmCmd() *cli.Command {
	return &cli.Command{Name: "rm", Usage: "remove stopped or finished tasks (-f: running ones too, stopped at once first)", ArgsUsage: "TASK... (name, id or id prefix)",
		Flags: append(connFlags(),
			&cli.BoolFlag{Name: "force", Aliases: []string{"f"}, Usage: "terminate running tasks first (at once)"}),
		BashComplete: completeTasks,
		Action: func(c *cli.Context) error {
			if c.NArg() < 1 {
				return exitError{ctl.ExitFailure, "usage: tandem rm TASK..."}
			}
			return removeTasks(c, c.Args().Slice(), c.Bool("force"), 0, "removed")
		}}
}

func pruneCmd() *cli.Command {
	return &cli.Command{Name: "prune", Usage: "remove every finished task (terminated, or its job ended)", Flags: connFlags(),
		Action: func(c *cli.Context) error {
			infos, err := listTasks(c)
			if err != nil {
				return err
			}
			var refs []string
			for _, info := range infos {
				// As rm: a task whose job ended is finished, also while its
				// runner lingers for the logs to be collected.
				if info.Status == api.TaskTerminated || ctl.JobEnded(info) {
					refs = append(refs, info.ID)
				}
			}
			if len(refs) == 0 {
				fmt.Fprintln(c.App.ErrWriter, "no finished tasks")
				return nil
			}
			return removeTasks(c, refs, false, 0, "removed")
		}}
}

// listTasks reads every task of the shim (ctl.Client.Tasks).
func listTasks(c *cli.Context) ([]api.TaskInfoResponse, error) {
	cl, done, err := client(c, nil)
	if err != nil {
		return nil, err
	}
	defer done()
	infos, err := cl.Tasks(c.Context)
	if err != nil {
		return nil, exitError{ctl.ExitFailure, errText(err)}
	}
	return infos, nil
}

// sinceFlag turns --since into a point in time (zero: from the start).
func sinceFlag(c *cli.Context) time.Time {
	if d := c.Duration("since"); d > 0 {
		return time.Now().Add(-d)
	}
	return time.Time{}
}

// taskRefs lists names (or short ids) of the shim's tasks, for completion.
func taskRefs(c *cli.Context) []string {
	infos, err := listTasks(c)
	if err != nil {
		return nil
	}
	var out []string
	for _, info := range infos {
		out = append(out, ctl.DisplayName(info))
	}
	return out
}
