package ctl

// The words every verb of the package speaks: how a run ended (Result and
// its exit code) and how a task is named and read.

import (
	"fmt"
	"strings"

	"github.com/tandem-run/tandem/api"
)

// Result is how a run ended.
type Result struct {
	TaskID     string
	Name       string
	State      api.JobState
	ExitStatus *int
	Reason     api.TerminationReason
	Message    string
	// Interrupted: the user's signal ended the run.
	Interrupted bool
	// Detached: the job runs on; nothing was cleaned up.
	Detached bool
	// Kept: the run ended and left its task, stopped (RunOptions.Keep, and
	// the task got a container: see Run.End).
	Kept bool
	// KeptNames names the tasks kept: the run's name, or a multi-node
	// run's NAME-0, NAME-1... (Cluster.Execute).
	KeptNames []string
}

// endedWith takes the job's end from its final state event.
func (r *Result) endedWith(ev api.JobStateEvent) {
	r.State, r.ExitStatus, r.Reason, r.Message = ev.State, ev.ExitStatus, ev.TerminationReason, ev.TerminationMessage
}

// Exit codes of tandem itself, docker run's where docker has one.
const (
	ExitFailure     = 125 // tandem could not run the job: shim, pull, flags
	ExitInterrupted = 130 // the user's Ctrl-C (or SIGTERM) ended the run
	ExitMaxDuration = 124 // --max-duration ended the job (as timeout(1))
	ExitStopped     = 143 // someone else stopped the task (tandem stop, the server)
)

// ExitCode maps the result to a process exit code: the job's status when
// it ran (128+N when killed by signal N, as the runner reports), else one
// of the Exit* codes.
func (r Result) ExitCode() int {
	switch {
	case r.ExitStatus != nil:
		return *r.ExitStatus
	case r.State == api.JobDone:
		return 0
	case r.Interrupted:
		return ExitInterrupted
	case r.Reason == api.ReasonMaxDurationExceeded:
		return ExitMaxDuration
	case r.State == api.JobTerminated:
		return ExitStopped
	}
	return ExitFailure
}

// DisplayName is how people see a task: its name, else its short id.
func DisplayName(info api.TaskInfoResponse) string {
	if n := TaskName(info); n != "" {
		return n
	}
	return ShortID(info.ID)
}

// JobEnded says whether the shim knows the task's job ended (its runner
// may still linger for the logs to be collected): such a task is removed
// without --force.
func JobEnded(info api.TaskInfoResponse) bool {
	return info.Tandem != nil && info.Tandem.Job != nil && info.Tandem.Job.State.Final()
}

// endedWithTask takes the end of a task terminated before its job said
// how it ended: the shim's reason, and a stopped job when someone stopped
// it (a stop's terminate, seen before its remove: as a removed one).
func (r *Result) endedWithTask(info api.TaskInfoResponse) {
	r.Reason, r.Message = info.TerminationReason, info.TerminationMessage
	if stoppedBySomeone(info.TerminationReason) {
		r.State = api.JobTerminated
	}
}

// stoppedBySomeone says whether a task ended with reason because someone
// stopped it (a user, the server or its policies), not because it failed.
func stoppedBySomeone(reason api.TerminationReason) bool {
	switch reason {
	case api.ReasonTerminatedByUser, api.ReasonAbortedByUser, api.ReasonTerminatedByServer, api.ReasonScaledDown,
		api.ReasonInactivityDurationExceeded, api.ReasonTerminatedByUtilization:
		return true
	}
	return false
}

// TaskName is the task's name as the shim knows it ("" for a shim that
// does not say).
func TaskName(t api.TaskInfoResponse) string {
	if t.Tandem != nil {
		return t.Tandem.Name
	}
	return ""
}

// Ports are where a task's runner answers on the host (0: not given).
type Ports struct{ HTTP, SSH int }

// ShortID is the 8-character id prefix people see.
func ShortID(id string) string {
	if len(id) > 8 {
		return id[:8]
	}
	return id
}

// Describe renders a result in one line for people.
func Describe(r Result) string {
	switch {
	case r.State == api.JobDone:
		return "job done"
	case r.ExitStatus != nil && strings.TrimSpace(r.Message) != "":
		return fmt.Sprintf("job failed: exit status %d: %s", *r.ExitStatus, strings.TrimSpace(r.Message))
	case r.ExitStatus != nil:
		return fmt.Sprintf("job failed: exit status %d", *r.ExitStatus)
	case r.Reason != "":
		msg := strings.TrimSpace(r.Message)
		if msg != "" {
			return fmt.Sprintf("job %s: %s: %s", r.State, r.Reason, msg)
		}
		return fmt.Sprintf("job %s: %s", r.State, r.Reason)
	case strings.TrimSpace(r.Message) != "":
		// A multi-node run's node that died: the message says which.
		return fmt.Sprintf("job %s: %s", r.State, strings.TrimSpace(r.Message))
	}
	return "job " + string(r.State)
}
