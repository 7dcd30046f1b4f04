package api

import "encoding/json"

// MaxUpload is the most one upload_code or upload_archive body may hold:
// the runner answers 413 past it. dstack's server refuses code over 2 MiB
// unless its operator raises DSTACK_SERVER_CODE_UPLOAD_LIMIT; this leaves
// room for that and still bounds the disk a caller can fill.
const MaxUpload = 256 << 20

// MaxJSONBody is the most a JSON request body to either agent may hold
// (a job's submit with its commands and environment, a task's submit):
// they answer 413 past it.
const MaxJSONBody = 1 << 20

// SubmitBody is the body of the runner's POST /api/submit. Only the keys the
// server's include-list sends are modelled; the deprecated top-level run_spec
// and anything newer are ignored on decode.
type SubmitBody struct {
	Run             Run               `json:"run"`
	JobSpec         JobSpec           `json:"job_spec"`
	JobSubmission   JobSubmission     `json:"job_submission"`
	ClusterInfo     ClusterInfo       `json:"cluster_info"`
	Secrets         map[string]string `json:"secrets"`
	RepoCredentials *RepoCredentials  `json:"repo_credentials"`
	// LogQuotaHour is bytes per hour of job output; null or 0 means unlimited.
	LogQuotaHour int64 `json:"log_quota_hour"`
	// Tandem holds a Tandem client's additions; the dstack server never
	// sends it, and dstack's runner ignores it.
	Tandem *SubmitExtras `json:"tandem,omitempty"`
}

// SubmitExtras are what a Tandem client adds to a job's submit.
type SubmitExtras struct {
	// NoPull says no /api/pull reader will wait for the job's output (a
	// detached tandem run: the shim keeps the output and the final state),
	// so the runner leaves as soon as the job ended and its followers had
	// the end, giving its ports back, instead of waiting minutes for a pull.
	NoPull bool `json:"no_pull,omitempty"`
	// Run asks the runner to start the job as soon as it accepted the
	// submit, when there is no code to upload: one call where dstack's
	// client makes two (a round trip less over a long link). A Tandem
	// runner answers with a SubmitRunResponse whose Started is true;
	// dstack's runner ignores the field and answers as it always does,
	// and the client then calls /api/run.
	Run bool `json:"run,omitempty"`
	// Stdin is what the job reads on its standard input: "" (dstack's
	// runner, and what the dstack server gets) the job's terminal, where
	// nothing is ever typed, so a job that reads stdin waits forever;
	// StdinNone an input that ends at once, as `docker run` without -i
	// gives; StdinStream what the client sends on the runner's StdinPath
	// WebSocket (`docker run -i`). Its terminal stays its stdout, stderr
	// and controlling terminal (/dev/tty) whatever the mode (with TTY and
	// StdinStream its fd 0 as well). A Tandem runner refuses any other
	// value (400); dstack's runner ignores the field.
	Stdin string `json:"stdin,omitempty"`
	// TTY is the job's terminal size at its start (docker run -t): the
	// client's window. Nil: the kernel's default (0x0). With it the job's
	// StdinPath stream is open whatever Stdin says, for its resizes (with
	// StdinNone it carries no input); with StdinStream the input is typed
	// at the job's terminal, its fd 0 too (docker run -it): the line
	// discipline reads it as keys (Ctrl-C is SIGINT, the terminal echoes),
	// and the stream's close ends the typing only (a terminal has no end
	// of file to give). A Tandem runner refuses a size out of TermSize's bounds (400);
	// dstack's runner ignores the field.
	TTY *TermSize `json:"tty,omitempty"`
}

// SubmitExtras.Stdin modes.
const (
	// StdinNone: the job's standard input ends at once (reads see end of
	// file).
	StdinNone = "none"
	// StdinStream: the job reads what one client sends on StdinPath, and
	// end of file once that client closes the stream.
	StdinStream = "stream"
)

// StdinPath is a Tandem runner's WebSocket for a job submitted with
// StdinStream or a TTY size: the client sends the input as binary
// messages and ends it with a normal close, and its terminal's resizes as
// text messages (a StdinControl each, ParseStdinControl's bounds). The
// runner closes it, with the reason, when the job no longer reads, at a
// control message it cannot read (1007, 1009 past MaxStdinControl), and
// at input for a job that takes none (1003: a TTY job with StdinNone).
// One client per job; another, or a job with neither, is answered 409
// before the upgrade. dstack's runner answers 404.
const StdinPath = "/stdin_ws"

// RunnerTaskParam is the query parameter with which a Tandem client names
// the shim task whose runner it means, on every runner call: a Tandem
// runner that serves another task (the shim told it its own) answers 409,
// so a client never reads another task's output, states or job after the
// port's runner changed. dstack's server never sends it; dstack's runner
// ignores it.
const RunnerTaskParam = "tandem_task"

// LogsEndParam is the /logs_ws query parameter with which a Tandem client
// asks for the job's final state at the stream's end: a Tandem runner then
// sends one text message holding a LogsEnd before its close (the output is
// binary messages), and the client needs no pull to learn how the job
// ended. dstack's server never sends it; dstack's runner ignores it.
const LogsEndParam = "tandem_end"

// LogsSoFarParam is the /logs_ws query parameter with which a Tandem client
// asks for the output kept so far (from start_time on) and no more: a
// Tandem runner closes the stream once it sent what the job had written
// when the stream opened, as `docker logs --since` without -f. dstack's
// runner ignores it and follows, so a client sends it only to a runner
// whose healthcheck names a Tandem version.
const LogsSoFarParam = "tandem_so_far"

// LogsEnd is the text message that ends a /logs_ws stream asked with
// LogsEndParam.
type LogsEnd struct {
	End *JobStateEvent `json:"tandem_end"`
}

// SubmitRunResponse is a Tandem runner's answer to a submit that asked to
// run (SubmitExtras.Run): the job started, with /api/run's answer.
type SubmitRunResponse struct {
	Started bool `json:"started"`
	RunResponse
}

// Run identifies the run a job belongs to.
type Run struct {
	ID      string  `json:"id"`
	RunSpec RunSpec `json:"run_spec"`
}

// RunSpec is the subset of the run specification the runner reads.
type RunSpec struct {
	RunName           string           `json:"run_name"`
	RepoID            string           `json:"repo_id"`
	RepoData          *RepoData        `json:"repo_data"`
	Configuration     RunConfiguration `json:"configuration"`
	ConfigurationPath string           `json:"configuration_path"`
}

// RunConfiguration keeps the whole configuration object as sent, and its type.
type RunConfiguration struct {
	Type string
	Raw  json.RawMessage
}

// UnmarshalJSON keeps the raw object and picks out `type`.
func (c *RunConfiguration) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		*c = RunConfiguration{}
		return nil
	}
	var head struct {
		Type string `json:"type"`
	}
	if err := json.Unmarshal(b, &head); err != nil {
		return err
	}
	c.Type = head.Type
	c.Raw = append(json.RawMessage(nil), b...)
	return nil
}

// MarshalJSON writes the raw object back, or a minimal {"type": ...}.
func (c RunConfiguration) MarshalJSON() ([]byte, error) {
	if len(c.Raw) > 0 {
		return c.Raw, nil
	}
	if c.Type == "" {
		return []byte("null"), nil
	}
	return json.Marshal(struct {
		Type string `json:"type"`
	}{c.Type})
}

// JobSubmission identifies one submission (attempt) of a job.
type JobSubmission struct {
	ID string `json:"id"`
}

// JobSpec is what the runner executes.
type JobSpec struct {
	ReplicaNum     int               `json:"replica_num"`
	JobNum         int               `json:"job_num"`
	JobsPerReplica int               `json:"jobs_per_replica"`
	User           *JobUser          `json:"user"`
	Commands       []string          `json:"commands"`
	Env            map[string]string `json:"env"`
	SingleBranch   bool              `json:"single_branch"`
	// MaxDuration is seconds; null or 0 means none.
	MaxDuration int     `json:"max_duration"`
	SSHKey      *SSHKey `json:"ssh_key"`
	// WorkingDir null means the container's WORKDIR.
	WorkingDir *string `json:"working_dir"`
	// RepoDir null makes repo setup fail, as in dstack.
	RepoDir          *string       `json:"repo_dir"`
	RepoData         *RepoData     `json:"repo_data"`
	RepoExistsAction string        `json:"repo_exists_action"`
	FileArchives     []FileArchive `json:"file_archives"`
}

// JobUser selects the job's credentials; every field may be null.
type JobUser struct {
	UID       *int    `json:"uid"`
	GID       *int    `json:"gid"`
	Username  *string `json:"username"`
	Groupname *string `json:"groupname"`
}

// SSHKey is the inter-node key pair of a multi-node job.
type SSHKey struct {
	Private string `json:"private"`
	Public  string `json:"public"`
}

// FileArchive is one `files:` entry: an uploaded tar to extract at Path.
type FileArchive struct {
	ID   string `json:"id"`
	Path string `json:"path"`
}

// Repo types (the repo_data discriminator).
const (
	RepoRemote  = "remote"
	RepoLocal   = "local"
	RepoVirtual = "virtual"
)

// RepoData describes the job's code; RepoType picks which fields apply.
type RepoData struct {
	RepoType        string `json:"repo_type"`
	RepoName        string `json:"repo_name,omitempty"`
	RepoBranch      string `json:"repo_branch,omitempty"`
	RepoHash        string `json:"repo_hash,omitempty"`
	RepoConfigName  string `json:"repo_config_name,omitempty"`
	RepoConfigEmail string `json:"repo_config_email,omitempty"`
	RepoDir         string `json:"repo_dir,omitempty"`
}

// ClusterInfo describes the nodes of a (possibly multi-node) job.
type ClusterInfo struct {
	JobIPs      []string `json:"job_ips"`
	MasterJobIP string   `json:"master_job_ip"`
	GPUsPerJob  int      `json:"gpus_per_job"`
	GPUsPerNode []int    `json:"gpus_per_node"`
}

// RepoCredentials are used to clone a remote repo.
type RepoCredentials struct {
	CloneURL   string `json:"clone_url"`
	PrivateKey string `json:"private_key,omitempty"`
	OAuthToken string `json:"oauth_token,omitempty"`
}

// RunResponse answers the runner's POST /api/run.
type RunResponse struct {
	WorkingDir string `json:"working_dir"`
	Username   string `json:"username"`
}

// PullResponse answers GET /api/pull. The three lists are [] when empty.
type PullResponse struct {
	JobStates         []JobStateEvent `json:"job_states"`
	JobLogs           []LogEvent      `json:"job_logs"`
	RunnerLogs        []LogEvent      `json:"runner_logs"`
	LastUpdated       int64           `json:"last_updated"`
	NoConnectionsSecs int64           `json:"no_connections_secs"`
	HasMore           bool            `json:"has_more"`
}

// JobStateEvent is one entry of job_states. TerminationReason and
// TerminationMessage are always present ("" when none).
type JobStateEvent struct {
	State              JobState          `json:"state"`
	Timestamp          int64             `json:"timestamp"`
	TerminationReason  TerminationReason `json:"termination_reason"`
	TerminationMessage string            `json:"termination_message"`
	ExitStatus         *int              `json:"exit_status"`
}

// LogEvent is one chunk of log output; Message travels as standard base64.
type LogEvent struct {
	Message   []byte `json:"message"`
	Timestamp int64  `json:"timestamp"`
}

// MetricsResponse answers GET /api/metrics. GPUs is [] when there are none.
type MetricsResponse struct {
	TimestampMicro        int64        `json:"timestamp_micro"`
	CPUUsageMicro         uint64       `json:"cpu_usage_micro"`
	MemoryUsageBytes      uint64       `json:"memory_usage_bytes"`
	MemoryWorkingSetBytes uint64       `json:"memory_working_set_bytes"`
	GPUs                  []GPUMetrics `json:"gpus"`
}

// GPUMetrics is the usage of one GPU.
type GPUMetrics struct {
	GPUMemoryUsageBytes uint64 `json:"gpu_memory_usage_bytes"`
	GPUUtilPercent      int    `json:"gpu_util_percent"`
}
