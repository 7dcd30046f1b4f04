package api

import "slices"

// TaskStatus is the lifecycle status of a shim task.
type TaskStatus string

const (
	TaskPending    TaskStatus = "pending"
	TaskPreparing  TaskStatus = "preparing"
	TaskPulling    TaskStatus = "pulling"
	TaskCreating   TaskStatus = "creating"
	TaskRunning    TaskStatus = "running"
	TaskTerminated TaskStatus = "terminated"
)

// taskTransitions lists, for each target status, the statuses it may be
// committed from. pending is only ever an initial status. running → running
// commits port info; terminated may be reached from anything, itself included.
var taskTransitions = map[TaskStatus][]TaskStatus{
	TaskPreparing:  {TaskPending},
	TaskPulling:    {TaskPreparing},
	TaskCreating:   {TaskPulling},
	TaskRunning:    {TaskCreating, TaskRunning},
	TaskTerminated: {TaskPending, TaskPreparing, TaskPulling, TaskCreating, TaskRunning, TaskTerminated},
}

// Valid reports whether s is one of the wire values.
func (s TaskStatus) Valid() bool {
	switch s {
	case TaskPending, TaskPreparing, TaskPulling, TaskCreating, TaskRunning, TaskTerminated:
		return true
	}
	return false
}

// CanTransitionTo reports whether a task in status s may be committed to next.
// This is the one place the shim's state machine is checked.
func (s TaskStatus) CanTransitionTo(next TaskStatus) bool {
	return slices.Contains(taskTransitions[next], s)
}

// JobState is a state in the runner's job_states stream.
type JobState string

const (
	JobRunning     JobState = "running"
	JobDone        JobState = "done"
	JobFailed      JobState = "failed"
	JobTerminated  JobState = "terminated"
	JobTerminating JobState = "terminating" // in the enum, never emitted
)

// Final reports whether the state ends the job.
func (s JobState) Final() bool {
	return s == JobDone || s == JobFailed || s == JobTerminated
}

// jobTransitions lists, for each state, the states the job_states stream
// may hold just before it ("" is the empty stream). A job runs once and
// ends once: running comes first or not at all (a setup failure ends a job
// that never ran), and nothing follows a final state.
var jobTransitions = map[JobState][]JobState{
	JobRunning:    {""},
	JobDone:       {JobRunning},
	JobFailed:     {"", JobRunning},
	JobTerminated: {"", JobRunning},
}

// CanFollow reports whether a job may enter state s when its last state
// was prev ("" before any). The runner's one check of its job states.
func (s JobState) CanFollow(prev JobState) bool {
	return slices.Contains(jobTransitions[s], prev)
}

// TerminationReason mirrors the dstack server's JobTerminationReason enum. The
// server raises on any value outside it, so agents must only emit these.
type TerminationReason string

const (
	ReasonFailedToStartNoCapacity      TerminationReason = "failed_to_start_due_to_no_capacity"
	ReasonInterruptedByNoCapacity      TerminationReason = "interrupted_by_no_capacity"
	ReasonInstanceUnreachable          TerminationReason = "instance_unreachable"
	ReasonWaitingInstanceLimitExceeded TerminationReason = "waiting_instance_limit_exceeded"
	ReasonWaitingRunnerLimitExceeded   TerminationReason = "waiting_runner_limit_exceeded"
	ReasonTerminatedByUser             TerminationReason = "terminated_by_user"
	ReasonVolumeError                  TerminationReason = "volume_error"
	ReasonGatewayError                 TerminationReason = "gateway_error"
	ReasonScaledDown                   TerminationReason = "scaled_down"
	ReasonDoneByRunner                 TerminationReason = "done_by_runner"
	ReasonAbortedByUser                TerminationReason = "aborted_by_user"
	ReasonTerminatedByServer           TerminationReason = "terminated_by_server"
	ReasonInactivityDurationExceeded   TerminationReason = "inactivity_duration_exceeded"
	ReasonTerminatedByUtilization      TerminationReason = "terminated_due_to_utilization_policy"
	ReasonContainerExitedWithError     TerminationReason = "container_exited_with_error"
	ReasonPortsBindingFailed           TerminationReason = "ports_binding_failed"
	ReasonCreatingContainerError       TerminationReason = "creating_container_error"
	ReasonExecutorError                TerminationReason = "executor_error"
	ReasonMaxDurationExceeded          TerminationReason = "max_duration_exceeded"
	ReasonLogQuotaExceeded             TerminationReason = "log_quota_exceeded"
)

var terminationReasons = []TerminationReason{
	ReasonFailedToStartNoCapacity, ReasonInterruptedByNoCapacity, ReasonInstanceUnreachable,
	ReasonWaitingInstanceLimitExceeded, ReasonWaitingRunnerLimitExceeded, ReasonTerminatedByUser,
	ReasonVolumeError, ReasonGatewayError, ReasonScaledDown, ReasonDoneByRunner, ReasonAbortedByUser,
	ReasonTerminatedByServer, ReasonInactivityDurationExceeded, ReasonTerminatedByUtilization,
	ReasonContainerExitedWithError, ReasonPortsBindingFailed, ReasonCreatingContainerError,
	ReasonExecutorError, ReasonMaxDurationExceeded, ReasonLogQuotaExceeded,
}

// Valid reports whether r is a value the server's enum accepts. The empty
// reason is not valid: a task or job that ends on its own must carry one.
func (r TerminationReason) Valid() bool {
	return slices.Contains(terminationReasons, r)
}

// ComponentName names a binary the shim manages.
type ComponentName string

const (
	ComponentRunner ComponentName = "dstack-runner"
	ComponentShim   ComponentName = "dstack-shim"
)

// ComponentStatus is the install status of a component.
type ComponentStatus string

const (
	ComponentNotInstalled ComponentStatus = "not-installed"
	ComponentInstalled    ComponentStatus = "installed"
	ComponentInstalling   ComponentStatus = "installing"
	ComponentError        ComponentStatus = "error"
)

// GPUVendor as reported in host_info.json and /api/instance/info.
type GPUVendor string

const (
	GPUVendorNone        GPUVendor = "none"
	GPUVendorNVIDIA      GPUVendor = "nvidia"
	GPUVendorAMD         GPUVendor = "amd"
	GPUVendorIntel       GPUVendor = "intel"
	GPUVendorTenstorrent GPUVendor = "tenstorrent"
)

// Service names reported by the healthchecks.
const (
	ServiceShim   = "dstack-shim"
	ServiceRunner = "dstack-runner"
)
