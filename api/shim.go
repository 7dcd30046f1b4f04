package api

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
)

// HealthcheckResponse answers GET /api/healthcheck of both agents.
type HealthcheckResponse struct {
	Service string `json:"service"`
	Version string `json:"version"`
	// TandemVersion is Tandem's own release (not in dstack's agents; the
	// server ignores it). Version stays exactly the dstack release.
	TandemVersion string `json:"tandem_version,omitempty"`
	// TaskID is the shim task a Tandem runner serves (its shim passes it):
	// a client that reaches a port a previous task's runner is still
	// leaving can tell it is not its own.
	TaskID string `json:"tandem_task_id,omitempty"`
	// RunnerHTTPPort is where a Tandem shim's host-network tasks' runners
	// serve their API (its --runner-http-port): a client that runs on the
	// host network waits for its runner there beside its submit, which a
	// Tandem shim answers only once the task runs. 0 from a runner.
	RunnerHTTPPort int `json:"tandem_runner_http_port,omitempty"`
}

// ShutdownRequest is the body of POST /api/shutdown.
type ShutdownRequest struct {
	Force bool `json:"force"`
}

// InstanceHealthResponse answers GET /api/instance/health. DCGM is null when
// libdcgm is not in use or its health query failed.
type InstanceHealthResponse struct {
	DCGM *DCGMHealth `json:"dcgm"`
}

// DCGM health results (dcgmHealthWatchResult): the only values the dstack
// server accepts in overall_health and each incident's health.
const (
	HealthPass = 0
	HealthWarn = 10
	HealthFail = 20
)

// DCGMHealth carries raw DCGM enum values (health: HealthPass, HealthWarn,
// HealthFail).
type DCGMHealth struct {
	OverallHealth int            `json:"overall_health"`
	Incidents     []DCGMIncident `json:"incidents"`
}

// DCGMIncident is one DCGM health incident.
type DCGMIncident struct {
	System        int    `json:"system"`
	Health        int    `json:"health"`
	ErrorMessage  string `json:"error_message"`
	ErrorCode     int    `json:"error_code"`
	EntityGroupID int    `json:"entity_group_id"`
	EntityID      int    `json:"entity_id"`
}

// InstanceInfoResponse answers GET /api/instance/info; both keys are omitted
// when empty (no GPUs → {}).
type InstanceInfoResponse struct {
	GPUVendor        GPUVendor `json:"gpu_vendor,omitempty"`
	GPUDriverVersion string    `json:"gpu_driver_version,omitempty"`
}

// InstanceHostResponse answers GET /api/instance/host (Tandem's own route;
// the dstack server never calls it): the host's name, its non-loopback
// addresses in CIDR form and its GPU count, for the cluster_info of a
// multi-node run (the addresses the nodes reach each other at, the GPUs
// per node).
type InstanceHostResponse struct {
	Hostname  string   `json:"hostname"`
	Addresses []string `json:"addresses"`
	GPUCount  int      `json:"gpu_count"`
}

// ComponentInfo is one entry of GET /api/components.
type ComponentInfo struct {
	Name    ComponentName   `json:"name"`
	Version string          `json:"version"`
	Status  ComponentStatus `json:"status"`
	// InstallError is why the last install was refused or failed (ours; the
	// server ignores it). The binary that was in place stays and is what
	// Version and Status describe.
	InstallError string `json:"install_error,omitempty"`
}

// ComponentListResponse answers GET /api/components (always both, runner first).
type ComponentListResponse struct {
	Components []ComponentInfo `json:"components"`
}

// ComponentInstallRequest is the body of POST /api/components/install.
type ComponentInstallRequest struct {
	Name ComponentName `json:"name"`
	URL  string        `json:"url"`
}

// TaskConfig is the body of POST /api/tasks.
type TaskConfig struct {
	ID               string               `json:"id"`
	Name             string               `json:"name"`
	ImageName        string               `json:"image_name"`
	RegistryUsername string               `json:"registry_username"`
	RegistryPassword string               `json:"registry_password"`
	ContainerUser    string               `json:"container_user"`
	Privileged       bool                 `json:"privileged"`
	GPU              int                  `json:"gpu"`
	CPU              float64              `json:"cpu"`
	Memory           int64                `json:"memory"`
	ShmSize          int64                `json:"shm_size"`
	NetworkMode      string               `json:"network_mode"`
	Volumes          []VolumeInfo         `json:"volumes"`
	VolumeMounts     []VolumeMountPoint   `json:"volume_mounts"`
	InstanceMounts   []InstanceMountPoint `json:"instance_mounts"`
	GPUDevices       []GPUDevice          `json:"gpu_devices"`
	HostSSHUser      string               `json:"host_ssh_user"`
	HostSSHKeys      []string             `json:"host_ssh_keys"`
	ContainerSSHKeys []string             `json:"container_ssh_keys"`
	// PidsLimit is a Tandem client's own bound on the task's processes
	// and threads (the dstack server never sends it; 0: the shim's).
	PidsLimit int64 `json:"tandem_pids_limit,omitempty"`
	// Publish is a Tandem client's job ports to publish on the host, as
	// docker run -p (bridge network only; the dstack server never sends
	// it, and dstack's shim ignores it).
	Publish []PublishedPort `json:"tandem_publish,omitempty"`
}

// PublishedPort is one job port published on the host (docker run -p
// [HOST_IP:][HOST_PORT:]CONTAINER_PORT[/PROTOCOL]).
type PublishedPort struct {
	// HostIP is the host address it binds; empty: every address.
	HostIP string `json:"host_ip,omitempty"`
	// HostPort is the host's port; 0: one Docker picks.
	HostPort int `json:"host_port,omitempty"`
	// ContainerPort is the job's port.
	ContainerPort int `json:"container_port"`
	// Protocol is tcp (empty) or udp.
	Protocol string `json:"protocol,omitempty"`
}

// Proto is the port's protocol, "tcp" where the field is empty.
func (p PublishedPort) Proto() string {
	if p.Protocol == "" {
		return "tcp"
	}
	return p.Protocol
}

// VolumeInfo describes a network volume to attach-mount on the host.
type VolumeInfo struct {
	Backend    string `json:"backend"`
	Name       string `json:"name"`
	VolumeID   string `json:"volume_id"`
	InitFS     bool   `json:"init_fs"`
	DeviceName string `json:"device_name"`
}

// VolumeMountPoint binds /mnt/disks/dstack-volumes/<name> at Path.
type VolumeMountPoint struct {
	Name string `json:"name"`
	Path string `json:"path"`
}

// InstanceMountPoint binds a host path into the container. The server also
// sends `optional`; it is kept for round trips and not acted upon.
type InstanceMountPoint struct {
	InstancePath string `json:"instance_path"`
	Path         string `json:"path"`
	Optional     bool   `json:"optional,omitempty"`
	// MustExist is a Tandem client's: a host path that does not exist is
	// refused at submit (400), never created (docker's --mount). Without
	// it a missing path is created, as dstack's server expects of the
	// shim (an instance volume's first use), with mode 0755.
	MustExist bool `json:"tandem_must_exist,omitempty"`
	// ReadOnly is a Tandem client's: the path is bound read-only (docker's
	// -v SRC:DST:ro). dstack's shim does not know it: a client sends it
	// to a Tandem shim only.
	ReadOnly bool `json:"tandem_read_only,omitempty"`
}

// GPUDevice is an explicit device node that replaces vendor GPU wiring.
type GPUDevice struct {
	PathOnHost      string `json:"path_on_host"`
	PathInContainer string `json:"path_in_container"`
}

// PortMapping is one published container port.
type PortMapping struct {
	Host      int `json:"host"`
	Container int `json:"container"`
}

// ImagePullProgress aggregates the layers of an image pull.
type ImagePullProgress struct {
	DownloadedBytes   int64 `json:"downloaded_bytes"`
	ExtractedBytes    int64 `json:"extracted_bytes"`
	TotalBytes        int64 `json:"total_bytes"`
	IsTotalBytesFinal bool  `json:"is_total_bytes_final"`
}

// TaskInfoResponse answers GET /api/tasks/{id} and POST .../terminate.
//
// Ports is null until the container started ([]PortMapping(nil)), [] in host
// network mode, and the published mappings in bridge mode. GPUIDs is spelled
// `gpus_ids` on the wire; null before allocation, [] for no GPUs.
type TaskInfoResponse struct {
	ID                 string             `json:"id"`
	Status             TaskStatus         `json:"status"`
	TerminationReason  TerminationReason  `json:"termination_reason"`
	TerminationMessage string             `json:"termination_message"`
	Ports              []PortMapping      `json:"ports"`
	ImagePullProgress  *ImagePullProgress `json:"image_pull_progress"`
	ContainerName      string             `json:"container_name"`
	ContainerID        string             `json:"container_id"`
	GPUIDs             []string           `json:"gpus_ids"`
	// Tandem holds Tandem's additions; a dstack server reads shim answers
	// with extra fields ignored, so it never sees them.
	Tandem *TaskDetails `json:"tandem,omitempty"`
}

// TaskDetails is what a client needs to find and show a task without
// knowing how the shim was started: its name and image, when it was
// submitted, and where its runner answers on the host.
type TaskDetails struct {
	Name        string `json:"name"`
	ImageName   string `json:"image_name"`
	NetworkMode string `json:"network_mode"`
	GPU         int    `json:"gpu"` // as asked: -1 all
	// SubmittedAt is the submit time in Unix seconds (0: unknown).
	SubmittedAt int64 `json:"submitted_at,omitempty"`
	// RunnerHTTPPort and RunnerSSHPort are the host ports where the task's
	// runner answers (host network: the shim's runner ports; bridge: the
	// published ones); 0 until known.
	RunnerHTTPPort int `json:"runner_http_port,omitempty"`
	RunnerSSHPort  int `json:"runner_ssh_port,omitempty"`
	// Job is the job's final state as its runner left it (set once the job
	// ended, kept after the runner and its container are gone): its exit
	// status outlives them.
	Job *JobStateEvent `json:"job,omitempty"`
	// HostKeys are the runner's SSH host public keys ("ssh-ed25519 AAAA..."),
	// once it wrote them: a client pins them instead of trusting the
	// first key it sees.
	HostKeys []string `json:"ssh_host_keys,omitempty"`
	// CPU and Memory are the task's limits as submitted (cores, bytes;
	// 0: none), so a client can show use against them.
	CPU    float64 `json:"cpu,omitempty"`
	Memory int64   `json:"memory,omitempty"`
	// Published are the job's ports published on the host (tandem_publish)
	// as Docker bound them, one per address family and port, the host port
	// Docker picked where the submit left it 0; the runner's ports are
	// never among them. Set while the task runs, as docker ps shows a
	// container's ports only while it runs.
	Published []PublishedPort `json:"published,omitempty"`
}

// TaskImageConfig answers GET /api/tasks/{id}/image-config (Tandem's own
// route; the dstack server never calls it, it reads an image's config from
// its registry): the config of the image the task's container was made
// from, as Docker's image inspect has it. A client that runs the image's
// own command (tandem run IMAGE, no command) takes Entrypoint then Cmd as
// the job's argv, as docker run and the dstack server do. Entrypoint, Cmd
// and Env are [] when the image sets none.
type TaskImageConfig struct {
	// Image is the image's id (sha256:...): the one the container runs,
	// whatever its tag names now.
	Image      string   `json:"image"`
	Entrypoint []string `json:"entrypoint"`
	Cmd        []string `json:"cmd"`
	WorkingDir string   `json:"working_dir"`
	Env        []string `json:"env"`
	User       string   `json:"user"`
}

// TaskSubmitResponse is the body of a successful POST /api/tasks. dstack's shim
// serializes its internal struct there, so the keys are Go field names; the
// server ignores the body, but we keep the shape.
type TaskSubmitResponse struct {
	ID                 string             `json:"ID"`
	Status             TaskStatus         `json:"Status"`
	TerminationReason  TerminationReason  `json:"TerminationReason"`
	TerminationMessage string             `json:"TerminationMessage"`
	Ports              []PortMapping      `json:"Ports"`
	ImagePullProgress  *ImagePullProgress `json:"ImagePullProgress"`
	ContainerName      string             `json:"ContainerName"`
	ContainerID        string             `json:"ContainerID"`
	GPUIDs             []string           `json:"GpuIDs"`
	// Tandem is the task's Tandem details, as GET /api/tasks/{id} has
	// them (the server ignores the body): a client whose submit was
	// answered once the task runs knows its runner's ports from the
	// answer, without a first look.
	Tandem *TaskDetails `json:"tandem,omitempty"`
}

// SubmitResponse converts a task info into the submit response shape
// (the same fields under dstack's shim's keys).
func (t TaskInfoResponse) SubmitResponse() TaskSubmitResponse { return TaskSubmitResponse(t) }

// Info is the submit's answer as a task info.
func (t TaskSubmitResponse) Info() TaskInfoResponse { return TaskInfoResponse(t) }

// TaskListItem is one entry of GET /api/tasks.
type TaskListItem struct {
	ID     string     `json:"id"`
	Status TaskStatus `json:"status"`
}

// TaskListResponse answers GET /api/tasks. Tasks is [] when empty. Shims
// 0.18.34-0.19.25 answered {"ids": [...]} instead; IDs receives that form.
type TaskListResponse struct {
	Tasks []TaskListItem `json:"tasks"`
	IDs   []string       `json:"ids,omitempty"`
}

// TaskTerminateRequest is the body of POST /api/tasks/{id}/terminate. Timeout
// is seconds of graceful stop (an integer, whatever the OpenAPI file says).
type TaskTerminateRequest struct {
	TerminationReason  TerminationReason `json:"termination_reason"`
	TerminationMessage string            `json:"termination_message"`
	Timeout            uint              `json:"timeout"`
}

// HostInfo is <shim home>/host_info.json, read by SSH-fleet onboarding.
type HostInfo struct {
	GPUVendor GPUVendor `json:"gpu_vendor"`
	GPUName   string    `json:"gpu_name"`
	GPUMemory MiB       `json:"gpu_memory"`
	GPUCount  int       `json:"gpu_count"`
	Addresses []string  `json:"addresses"`
	DiskSize  uint64    `json:"disk_size"`
	CPUs      int       `json:"cpus"`
	Memory    uint64    `json:"memory"`
}

// MiB is an amount of memory in mebibytes. It encodes as a JSON integer and
// also decodes the string form older shims wrote ("16384 MiB").
type MiB int64

// UnmarshalJSON accepts 16384, "16384" and "16384 MiB".
func (m *MiB) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		return nil
	}
	if len(b) > 0 && b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		s = strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(s), "MiB"))
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return fmt.Errorf("gpu memory %q: not a MiB amount", s)
		}
		*m = MiB(n)
		return nil
	}
	var n int64
	if err := json.Unmarshal(b, &n); err != nil {
		return fmt.Errorf("gpu memory: %w", err)
	}
	*m = MiB(n)
	return nil
}

// Legacy API v1 (shims < 0.18.34). Tandem reports a newer version and never
// receives these calls; the types exist so tools can speak to old shims.

// LegacySubmitRequest is the body of the removed POST /api/submit.
type LegacySubmitRequest struct {
	Username       string               `json:"username"`
	Password       string               `json:"password"`
	ImageName      string               `json:"image_name"`
	Privileged     bool                 `json:"privileged"`
	ContainerName  string               `json:"container_name"`
	ContainerUser  string               `json:"container_user"`
	ShmSize        int64                `json:"shm_size"`
	PublicKeys     []string             `json:"public_keys"`
	SSHUser        string               `json:"ssh_user"`
	SSHKey         string               `json:"ssh_key"`
	Mounts         []VolumeMountPoint   `json:"mounts"`
	Volumes        []VolumeInfo         `json:"volumes"`
	InstanceMounts []InstanceMountPoint `json:"instance_mounts"`
}

// LegacyPullResponse answers the removed GET /api/pull of the shim.
type LegacyPullResponse struct {
	State  string          `json:"state"`
	Result LegacyJobResult `json:"result"`
}

// LegacyJobResult is the result of a legacy task.
type LegacyJobResult struct {
	Reason        string `json:"reason"`
	ReasonMessage string `json:"reason_message"`
}

// LegacyStopRequest is the optional body of the removed POST /api/stop.
type LegacyStopRequest struct {
	Force bool `json:"force"`
}

// LegacyStopResponse answers the removed POST /api/stop.
type LegacyStopResponse struct {
	State string `json:"state"`
}
