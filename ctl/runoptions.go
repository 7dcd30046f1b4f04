package ctl

import (
	"io"
	"time"

	"github.com/tandem-run/tandem/api"
)

// RunOptions describe one run: its task and its job. Where it runs (the
// shim, its runner's port, the dialer, the clock, what it reports to) is
// its Client's Config.
type RunOptions struct {
	Name  string
	Image string
	// RegistryUsername and RegistryPassword authenticate the image pull.
	RegistryUsername, RegistryPassword string
	GPUs                               int // -1 all, 0 none
	CPU                                float64
	Memory                             int64
	ShmSize                            int64
	PidsLimit                          int64 // 0: the shim's
	Env                                map[string]string
	WorkDir                            string
	CodeDir                            string
	// CodeLimit is the largest code archive to send, checked before the
	// task is made (0: api.MaxUpload, the runner's default; < 0: none).
	CodeLimit int64
	Mounts    []api.InstanceMountPoint
	Network   string // host or bridge
	// User is who the job runs as in the container (docker run -u): a
	// name or uid, with :group or :gid; "": the image's.
	User string
	// Privileged runs the container privileged (dstack's privileged).
	Privileged  bool
	MaxDuration time.Duration
	// SSHKeys are public keys authorized in the job container (tandem ssh).
	SSHKeys []string
	// Commands is the job's argv; none: the image's ENTRYPOINT and CMD
	// (imagecmd.go).
	Commands []string
	// Entrypoint, when not nil, replaces the image's ENTRYPOINT with
	// Commands its arguments, as docker run --entrypoint (the image's CMD
	// unused); empty with no Commands is refused.
	Entrypoint []string
	// Detach returns once the job runs, leaving the task (tandem attach,
	// logs, rm).
	Detach bool
	// Keep leaves the task once the run ends, stopped: its output, exit
	// status and task row stay until it is removed (docker run without
	// --rm). Without it the task is removed at the end (docker run --rm).
	Keep bool
	// Publish are job ports published on the host, as docker run -p
	// (bridge network, a Tandem shim: Run.Submit refuses dstack's).
	Publish []api.PublishedPort
	// Stdin, when set, is what the job reads on its standard input, sent
	// to its runner as it comes (docker run -i; a Tandem runner only); nil:
	// an input that ends at once (docker run without -i).
	Stdin io.Reader
	// TTY, when set, is the job's terminal size at its start (docker run
	// -t: the user's window); with Stdin the input is typed at that
	// terminal (docker run -it: keys, Ctrl-C the job's SIGINT). Resizes,
	// when set, carries the window's later sizes (the CLI's SIGWINCH), sent
	// to the runner as they come until the run ends; a runner that takes
	// none (dstack's) is not resized. A multi-node run sizes and resizes
	// node 0's terminal only, the one whose output is shown as is.
	TTY     *api.TermSize
	Resizes <-chan api.TermSize
	// Started, when set, is called once the job runs (e.g. to write the
	// task's SSH config entry).
	Started func(info api.TaskInfoResponse)
	Out     io.Writer // job output
	// Workers receives the other nodes' job output in a multi-node run
	// (nil: it is not shown).
	Workers io.Writer
}
