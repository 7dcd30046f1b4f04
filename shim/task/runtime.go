package task

import (
	"context"
	"errors"
	"io"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/shim/gpu"
)

// Runtime is what the engine needs from the container engine. shim/dockerrt
// implements it on Docker; tests may use anything that behaves the same.
type Runtime interface {
	// ImagePresent reports whether ref is in the local image store.
	ImagePresent(ctx context.Context, ref string) (bool, error)
	// Pull starts pulling ref and returns Docker's JSON progress stream.
	Pull(ctx context.Context, ref string, auth RegistryAuth) (io.ReadCloser, error)
	// Create creates (does not start) a container and returns its id.
	Create(ctx context.Context, spec ContainerSpec) (string, error)
	// Start starts a created container.
	Start(ctx context.Context, id string) error
	// Address returns a started container's IPv4 address on network
	// (any of its networks when "").
	Address(ctx context.Context, id, network string) (string, error)
	// Wait blocks until the container is not running and returns its exit code.
	Wait(ctx context.Context, id string) (int, error)
	// Stop signals the container and kills it after timeout.
	Stop(ctx context.Context, id string, timeout time.Duration) error
	// Remove force-removes a container and its anonymous volumes; a missing
	// container is not an error.
	Remove(ctx context.Context, idOrName string) error
	// LogTail returns the last n lines of the container's output.
	LogTail(ctx context.Context, id string, n int) (string, error)
	// Containers lists the shim's labelled containers, stopped ones too.
	Containers(ctx context.Context) ([]ContainerState, error)
	// Inspect returns one container's state; ErrContainerGone if it is gone.
	Inspect(ctx context.Context, id string) (ContainerState, error)
	// ImageConfig returns the config of the image a container was made
	// from (Entrypoint, Cmd and Env [] when unset); ErrContainerGone if
	// the container is gone.
	ImageConfig(ctx context.Context, containerID string) (api.TaskImageConfig, error)
	// GPUMode says how the engine reaches NVIDIA GPUs: "hook" (the NVIDIA
	// runtime), "cdi" (CDI device requests) or "" (neither).
	GPUMode(ctx context.Context) (string, error)
}

// ErrContainerGone means the container does not exist (any more).
var ErrContainerGone = errors.New("container not found")

// ErrNoImage is a create refused because the image is not in the local
// store: the engine pulls it, then creates again.
var ErrNoImage = errors.New("image not in the local store")

// ErrNothingCreated marks a create that surely made no container: Docker
// could not be reached, or refused the request. After any other failure
// (a timeout, a 500) one may exist, and remove looks for it by name.
var ErrNothingCreated = errors.New("no container was created")

// ErrNoModeset is a start refused because the NVIDIA hook wants
// /dev/nvidia-modeset (the display capability) on a headless host; the
// runtime classifies Docker's message, the engine retries without it.
var ErrNoModeset = errors.New("no /dev/nvidia-modeset on this host")

// ErrNoCDIDevice is a start refused because no CDI spec on the host names
// a GPU the task asked for (none generated, or one older than the driver
// or the GPUs): the fix is the host's, and says so.
var ErrNoCDIDevice = errors.New("no CDI spec on this host names the GPU; on the host, generate one: " + gpu.CDIGenerate)

// ContainerState is what recovery needs to know about a container.
type ContainerState struct {
	ID, Name, TaskID string
	ShimHome         string // LabelShimHome: which shim created it ("" if unknown)
	RunnerDir        string // host side of its bind at RunnerDirInContainer ("" if none)
	Running          bool
	NeverStarted     bool // created but not started
	ExitCode         int
	GPUIDs           []string
	Ports            []api.PortMapping
	// Published is every port binding Docker holds for it, each address
	// family and protocol (Ports has the IPv4 TCP ones only).
	Published []api.PublishedPort
}

// RegistryAuth are credentials for a private registry.
type RegistryAuth struct {
	Username, Password, ServerAddress string
}

// ContainerSpec is a container, in the engine's words.
type ContainerSpec struct {
	Name        string
	Image       string
	User        string
	Entrypoint  []string
	Cmd         []string
	Env         []string
	Labels      map[string]string
	NetworkMode string
	Privileged  bool
	// ExposedTCP ports are published on 127.0.0.1 with ephemeral host ports
	// (Docker ignores publishing in host network mode), unless Forwarded.
	ExposedTCP []int
	// Forwarded: the shim forwards ExposedTCP itself (shim/portfwd), so
	// Docker publishes nothing.
	Forwarded bool
	// Published are the job's ports published on the host (docker run
	// -p), in bridge network mode only, whatever Forwarded says.
	Published        []api.PublishedPort
	Binds            []Bind
	ShmSize          int64 // >0: /dev/shm is an exec tmpfs of this size
	PidsLimit        int64 // >0: the container's processes and threads at most
	NanoCPUs         int64
	Memory           int64
	Devices          []Device
	MemlockUnlimited bool
	// Init runs the command under Docker's init, so SIGTERM reaches it.
	Init bool
	// GPU wiring (only for tasks holding GPUs).
	GPUs        *GPURequest
	Runtime     string
	IpcMode     string
	CapAdd      []string
	SecurityOpt []string
}

// GPURequest is a Docker device request: the NVIDIA hook (Driver "") or CDI
// (Driver "cdi", qualified device names).
type GPURequest = gpu.Request

// Bind is a bind mount.
type Bind struct {
	Source, Target string
	ReadOnly       bool
}

// Device is a device node mapping.
type Device struct {
	Host, Container, Perms string
}
