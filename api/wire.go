package api

// Where dstack's agents meet: the ports the server connects to and the
// paths the shim binds into every task container. Flags and constructors
// take their defaults from here.
const (
	// ShimHTTPPort is the shim's API port.
	ShimHTTPPort = 10998
	// RunnerHTTPPort is the runner's API port inside a task.
	RunnerHTTPPort = 10999
	// RunnerSSHPort is the runner's SSH port inside a task.
	RunnerSSHPort = 10022
	// DCGMExporterHTTPPort is where the shim looks for a host dcgm-exporter.
	DCGMExporterHTTPPort = 10997

	// RunnerDirInContainer is the runner's temp dir, bound from the host.
	RunnerDirInContainer = "/tmp/runner"
	// RunnerBinaryInContainer is where the host's runner binary is bound.
	RunnerBinaryInContainer = "/usr/local/bin/dstack-runner"
	// RunnerFinalFile is where, in its temp dir (the shim's
	// runners/<container>/ on the host), the runner leaves the job's final
	// state: the shim reads it, so the job's status outlives the runner
	// and its container.
	RunnerFinalFile = "job_final.json"
	// RunnerHostKeysFile is where, in its temp dir, the runner leaves its
	// SSH host public keys (authorized_keys lines), for the shim to report
	// and a client to pin.
	RunnerHostKeysFile = "ssh_host_keys.pub"
)
