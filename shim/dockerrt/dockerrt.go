// Package dockerrt runs the shim's containers on a Docker Engine through its
// API (github.com/docker/docker/client).
package dockerrt

import (
	"bytes"
	"cmp"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/api/types/image"
	"github.com/docker/docker/api/types/mount"
	"github.com/docker/docker/api/types/registry"
	"github.com/docker/docker/client"
	"github.com/docker/docker/pkg/stdcopy"
	"github.com/docker/go-connections/nat"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/shim/gpu"
	"github.com/tandem-run/tandem/shim/task"
)

// Runtime is a task.Runtime on Docker.
type Runtime struct {
	c      *client.Client
	images shared[bool] // concurrent ImagePresent calls of one image share one inspect
}

// New connects with the standard Docker environment (DOCKER_HOST, ...) and
// API version negotiation.
func New() (*Runtime, error) {
	c, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		return nil, fmt.Errorf("docker client: %w", err)
	}
	return &Runtime{c: c}, nil
}

// Client exposes the underlying client (for info and listings).
func (r *Runtime) Client() *client.Client { return r.c }

// Close releases the client.
func (r *Runtime) Close() error { return r.c.Close() }

// Ping checks the daemon answers.
func (r *Runtime) Ping(ctx context.Context) error {
	if _, err := r.c.Ping(ctx); err != nil {
		return fmt.Errorf("docker ping: %w", err)
	}
	return nil
}

// ImagePresent reports whether ref is in the local store.
func (r *Runtime) ImagePresent(ctx context.Context, ref string) (bool, error) {
	return r.images.do(ctx, ref, func(ctx context.Context) (bool, error) {
		if _, err := r.c.ImageInspect(ctx, ref); err != nil {
			if cerrdefs.IsNotFound(err) {
				return false, nil
			}
			return false, fmt.Errorf("inspect image %s: %w", ref, err)
		}
		return true, nil
	})
}

// Pull starts a pull and returns the JSON progress stream.
func (r *Runtime) Pull(ctx context.Context, ref string, auth task.RegistryAuth) (io.ReadCloser, error) {
	opts := image.PullOptions{}
	if auth.Username != "" || auth.Password != "" {
		b, err := json.Marshal(registry.AuthConfig{Username: auth.Username, Password: auth.Password, ServerAddress: auth.ServerAddress})
		if err != nil {
			return nil, fmt.Errorf("encode registry auth: %w", err)
		}
		opts.RegistryAuth = base64.URLEncoding.EncodeToString(b)
	}
	rc, err := r.c.ImagePull(ctx, ref, opts)
	if err != nil {
		return nil, fmt.Errorf("pull %s: %w", ref, err)
	}
	return pullStream{ReadCloser: rc, done: func() { r.images.forget(ref) }}, nil
}

// ForgetImage drops what ImagePresent shares for ref: a pull of it that
// did not go through Pull (the fast path's load) just ended.
func (r *Runtime) ForgetImage(ref string) { r.images.forget(ref) }

// pullStream is a pull's progress stream. Once it is closed, an image
// check asks Docker afresh instead of joining one that started before the
// pull ended (and may have found the image missing).
type pullStream struct {
	io.ReadCloser
	done func()
}

func (p pullStream) Close() error {
	err := p.ReadCloser.Close()
	p.done()
	return err
}

// Create creates a container from spec.
func (r *Runtime) Create(ctx context.Context, s task.ContainerSpec) (string, error) {
	cfg, hc := Build(s)
	resp, err := r.c.ContainerCreate(ctx, cfg, hc, nil, nil, s.Name)
	if err != nil {
		if cerrdefs.IsNotFound(err) && strings.Contains(err.Error(), "No such image") {
			return "", fmt.Errorf("create container %s: %w: %w: %v", s.Name, task.ErrNoImage, task.ErrNothingCreated, err)
		}
		if nothingCreated(err) {
			return "", fmt.Errorf("create container %s: %w: %w", s.Name, err, task.ErrNothingCreated)
		}
		return "", fmt.Errorf("create container %s: %w", s.Name, err)
	}
	return resp.ID, nil
}

// nothingCreated says a create failed before Docker made anything: the
// daemon was not reached, or it refused the request as invalid, in
// conflict (the name is taken), not found or forbidden.
func nothingCreated(err error) bool {
	return client.IsErrConnectionFailed(err) || cerrdefs.IsInvalidArgument(err) || cerrdefs.IsConflict(err) ||
		cerrdefs.IsNotFound(err) || cerrdefs.IsPermissionDenied(err)
}

// Build turns a spec into Docker's create configuration.
func Build(s task.ContainerSpec) (*container.Config, *container.HostConfig) {
	exposed := nat.PortSet{}
	bindings := nat.PortMap{}
	for _, p := range s.ExposedTCP {
		port := nat.Port(strconv.Itoa(p) + "/tcp")
		exposed[port] = struct{}{}
		bindings[port] = []nat.PortBinding{{HostIP: "127.0.0.1"}}
	}
	cfg := &container.Config{
		Image:        s.Image,
		User:         s.User,
		Entrypoint:   s.Entrypoint,
		Cmd:          s.Cmd,
		Env:          s.Env,
		Labels:       s.Labels,
		ExposedPorts: exposed,
	}
	init := s.Init
	hc := &container.HostConfig{
		NetworkMode:  container.NetworkMode(s.NetworkMode),
		PortBindings: bindings,
		Privileged:   s.Privileged,
		Init:         &init,
		Runtime:      s.Runtime,
		IpcMode:      container.IpcMode(s.IpcMode),
		CapAdd:       s.CapAdd,
		SecurityOpt:  s.SecurityOpt,
		Resources: container.Resources{
			NanoCPUs: s.NanoCPUs,
			Memory:   s.Memory,
		},
	}
	if s.NetworkMode == "host" || s.Forwarded {
		hc.PortBindings = nat.PortMap{}
	}
	if s.NetworkMode != "host" {
		for _, p := range s.Published {
			port := nat.Port(strconv.Itoa(p.ContainerPort) + "/" + p.Proto())
			hostPort := ""
			if p.HostPort > 0 {
				hostPort = strconv.Itoa(p.HostPort)
			}
			exposed[port] = struct{}{}
			hc.PortBindings[port] = append(hc.PortBindings[port], nat.PortBinding{HostIP: p.HostIP, HostPort: hostPort})
		}
	}
	if len(hc.PortBindings) == 0 {
		hc.PortBindings = nil
	}
	for _, b := range s.Binds {
		hc.Mounts = append(hc.Mounts, mount.Mount{Type: mount.TypeBind, Source: b.Source, Target: b.Target, ReadOnly: b.ReadOnly})
	}
	if s.PidsLimit > 0 {
		limit := s.PidsLimit
		hc.Resources.PidsLimit = &limit
	}
	if s.ShmSize > 0 {
		hc.ShmSize = s.ShmSize
		hc.Tmpfs = map[string]string{"/dev/shm": "rw,nosuid,nodev,exec,size=" + strconv.FormatInt(s.ShmSize, 10)}
	}
	for _, d := range s.Devices {
		hc.Devices = append(hc.Devices, container.DeviceMapping{PathOnHost: d.Host, PathInContainer: d.Container, CgroupPermissions: d.Perms})
	}
	if s.MemlockUnlimited {
		hc.Ulimits = append(hc.Ulimits, &container.Ulimit{Name: "memlock", Soft: -1, Hard: -1})
	}
	if g := s.GPUs; g != nil {
		req := container.DeviceRequest{Driver: g.Driver, DeviceIDs: g.DeviceIDs}
		if len(g.Capabilities) > 0 {
			req.Capabilities = [][]string{g.Capabilities}
		}
		hc.DeviceRequests = []container.DeviceRequest{req}
	}
	return cfg, hc
}

// GPUMode reports how this Docker reaches NVIDIA GPUs: "hook" when the
// NVIDIA runtime is registered, "cdi" when CDI spec dirs are configured,
// "" when neither.
func (r *Runtime) GPUMode(ctx context.Context) (string, error) {
	mode, _, err := r.GPUAccess(ctx)
	return mode, err
}

// GPUAccess is GPUMode with the CDI spec dirs Docker reads (the GPU health
// check looks for a spec naming the GPUs there).
func (r *Runtime) GPUAccess(ctx context.Context) (mode string, cdiDirs []string, err error) {
	info, err := r.c.Info(ctx)
	if err != nil {
		return "", nil, fmt.Errorf("docker info: %w", err)
	}
	if _, ok := info.Runtimes["nvidia"]; ok {
		return "hook", info.CDISpecDirs, nil
	}
	if len(info.CDISpecDirs) > 0 {
		return "cdi", info.CDISpecDirs, nil
	}
	return "", nil, nil
}

// Start starts a container.
func (r *Runtime) Start(ctx context.Context, id string) error {
	if err := r.c.ContainerStart(ctx, id, container.StartOptions{}); err != nil {
		if strings.Contains(err.Error(), "/dev/nvidia-modeset") {
			return fmt.Errorf("start container %s: %w: %v", short(id), task.ErrNoModeset, err)
		}
		// Docker's own CDI and nvidia-container-runtime in CDI mode both
		// say so through the CDI library.
		if strings.Contains(err.Error(), "unresolvable CDI devices") {
			return fmt.Errorf("start container %s: %w: %v", short(id), task.ErrNoCDIDevice, err)
		}
		return fmt.Errorf("start container %s: %w", short(id), err)
	}
	return nil
}

// Address returns the container's IPv4 address on network, or on any of
// its networks when network is "" or not among them.
func (r *Runtime) Address(ctx context.Context, id, network string) (string, error) {
	ins, err := r.c.ContainerInspect(ctx, id)
	if err != nil {
		return "", fmt.Errorf("inspect container %s: %w", short(id), err)
	}
	if ins.NetworkSettings != nil {
		if n, ok := ins.NetworkSettings.Networks[network]; ok && n != nil && n.IPAddress != "" {
			return n.IPAddress, nil
		}
		names := make([]string, 0, len(ins.NetworkSettings.Networks))
		for name := range ins.NetworkSettings.Networks {
			names = append(names, name)
		}
		slices.Sort(names)
		for _, name := range names {
			if n := ins.NetworkSettings.Networks[name]; n != nil && n.IPAddress != "" {
				return n.IPAddress, nil
			}
		}
	}
	return "", fmt.Errorf("container %s has no IPv4 address", short(id))
}

func portsOf(ports nat.PortMap) []api.PortMapping {
	out := []api.PortMapping{}
	for port, binds := range ports {
		if port.Proto() != "tcp" {
			continue
		}
		for _, b := range binds {
			if strings.Contains(b.HostIP, ":") {
				continue // IPv6
			}
			hp, err := strconv.Atoi(b.HostPort)
			if err != nil {
				continue
			}
			out = append(out, api.PortMapping{Host: hp, Container: port.Int()})
		}
	}
	slices.SortFunc(out, func(a, b api.PortMapping) int { return cmp.Or(a.Container-b.Container, a.Host-b.Host) })
	return out
}

// publishedOf is every binding in ports, sorted by container port,
// protocol, then host address, as docker port lists them.
func publishedOf(ports nat.PortMap) []api.PublishedPort {
	out := []api.PublishedPort{}
	for port, binds := range ports {
		for _, b := range binds {
			hp, err := strconv.Atoi(b.HostPort)
			if err != nil {
				continue
			}
			out = append(out, api.PublishedPort{HostIP: b.HostIP, HostPort: hp, ContainerPort: port.Int(), Protocol: port.Proto()})
		}
	}
	slices.SortFunc(out, func(a, b api.PublishedPort) int {
		return cmp.Or(a.ContainerPort-b.ContainerPort, cmp.Compare(a.Protocol, b.Protocol), cmp.Compare(len(a.HostIP), len(b.HostIP)), cmp.Compare(a.HostIP, b.HostIP), a.HostPort-b.HostPort)
	})
	return out
}

// Containers lists the shim's labelled containers, stopped ones included.
func (r *Runtime) Containers(ctx context.Context) ([]task.ContainerState, error) {
	refs, err := r.ContainerRefs(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]task.ContainerState, 0, len(refs))
	for _, c := range refs {
		st, err := r.Inspect(ctx, c.ID)
		if err != nil {
			continue // removed between the list and the inspect
		}
		out = append(out, st)
	}
	return out, nil
}

// ContainerRefs lists the shim's labelled containers, stopped ones too,
// as the list shows them: one call, no inspect of each (the reconcile
// loop's tick; see task.Engine.Reconcile).
func (r *Runtime) ContainerRefs(ctx context.Context) ([]task.ContainerRef, error) {
	list, err := r.c.ContainerList(ctx, container.ListOptions{All: true, Filters: filters.NewArgs(filters.Arg("label", task.LabelIsTask+"=true"))})
	if err != nil {
		return nil, fmt.Errorf("list containers: %w", err)
	}
	out := make([]task.ContainerRef, 0, len(list))
	for _, c := range list {
		ref := task.ContainerRef{ID: c.ID, TaskID: c.Labels[task.LabelTaskID], ShimHome: c.Labels[task.LabelShimHome], Running: c.State == "running" || c.State == "paused" || c.State == "restarting"}
		for _, m := range c.Mounts {
			if m.Type == mount.TypeBind && m.Destination == task.RunnerDirInContainer {
				ref.RunnerDir = m.Source
			}
		}
		for _, n := range c.Names { // its own name, not a link's alias ("/a/b")
			if n = strings.TrimPrefix(n, "/"); !strings.Contains(n, "/") {
				ref.Name = n
				break
			}
		}
		out = append(out, ref)
	}
	return out, nil
}

// Inspect returns a container's state for recovery.
func (r *Runtime) Inspect(ctx context.Context, id string) (task.ContainerState, error) {
	ins, err := r.c.ContainerInspect(ctx, id)
	if cerrdefs.IsNotFound(err) {
		return task.ContainerState{}, task.ErrContainerGone
	}
	if err != nil {
		return task.ContainerState{}, fmt.Errorf("inspect container %s: %w", short(id), err)
	}
	st := task.ContainerState{ID: ins.ID, Name: strings.TrimPrefix(ins.Name, "/")}
	if ins.Config != nil {
		st.TaskID = ins.Config.Labels[task.LabelTaskID]
		st.ShimHome = ins.Config.Labels[task.LabelShimHome]
	}
	for _, m := range ins.Mounts { // whose it is, when unlabelled (task.ownerOf)
		if m.Type == mount.TypeBind && m.Destination == task.RunnerDirInContainer {
			st.RunnerDir = m.Source
		}
	}
	if ins.State != nil {
		st.Running = ins.State.Running || ins.State.Restarting || ins.State.Paused
		st.NeverStarted = ins.State.Status == "created"
		st.ExitCode = ins.State.ExitCode
	}
	if hc := ins.HostConfig; hc != nil {
		seen := gpu.Seen{Runtime: hc.Runtime}
		for _, dr := range hc.DeviceRequests {
			seen.RequestIDs = append(seen.RequestIDs, dr.DeviceIDs...)
		}
		for _, d := range hc.Devices {
			seen.Devices = append(seen.Devices, gpu.Device{Host: d.PathOnHost, Container: d.PathInContainer})
		}
		if ins.Config != nil {
			seen.Env = ins.Config.Env
		}
		st.GPUIDs = gpu.IDsFromContainer(seen)
		if hc.NetworkMode.IsHost() {
			st.Ports = []api.PortMapping{}
		}
	}
	if ins.NetworkSettings != nil {
		if st.Ports == nil {
			st.Ports = portsOf(ins.NetworkSettings.Ports)
		}
		st.Published = publishedOf(ins.NetworkSettings.Ports)
	}
	return st, nil
}

// ImageConfig returns the config of the image container id was made
// from, by the image's id (its tag may name another image by now).
func (r *Runtime) ImageConfig(ctx context.Context, id string) (api.TaskImageConfig, error) {
	ins, err := r.c.ContainerInspect(ctx, id)
	if cerrdefs.IsNotFound(err) {
		return api.TaskImageConfig{}, task.ErrContainerGone
	}
	if err != nil {
		return api.TaskImageConfig{}, fmt.Errorf("inspect container %s: %w", short(id), err)
	}
	img, err := r.c.ImageInspect(ctx, ins.Image)
	if err != nil {
		return api.TaskImageConfig{}, fmt.Errorf("inspect image %s: %w", short(ins.Image), err)
	}
	out := api.TaskImageConfig{Image: img.ID, Entrypoint: []string{}, Cmd: []string{}, Env: []string{}}
	if c := img.Config; c != nil {
		out.WorkingDir, out.User = c.WorkingDir, c.User
		out.Entrypoint = append(out.Entrypoint, c.Entrypoint...)
		out.Cmd = append(out.Cmd, c.Cmd...)
		out.Env = append(out.Env, c.Env...)
	}
	return out, nil
}

// Wait waits until the container is not running.
func (r *Runtime) Wait(ctx context.Context, id string) (int, error) {
	okCh, errCh := r.c.ContainerWait(ctx, id, container.WaitConditionNotRunning)
	select {
	case res := <-okCh:
		if res.Error != nil && res.Error.Message != "" {
			return int(res.StatusCode), fmt.Errorf("wait container %s: %s", short(id), res.Error.Message)
		}
		return int(res.StatusCode), nil
	case err := <-errCh:
		return -1, fmt.Errorf("wait container %s: %w", short(id), err)
	}
}

// Stop stops a container, killing it after timeout.
func (r *Runtime) Stop(ctx context.Context, id string, timeout time.Duration) error {
	secs := int(timeout / time.Second)
	if err := r.c.ContainerStop(ctx, id, container.StopOptions{Timeout: &secs}); err != nil && !cerrdefs.IsNotFound(err) {
		return fmt.Errorf("stop container %s: %w", short(id), err)
	}
	return nil
}

// Remove force-removes a container with its anonymous volumes.
func (r *Runtime) Remove(ctx context.Context, idOrName string) error {
	err := r.c.ContainerRemove(ctx, idOrName, container.RemoveOptions{Force: true, RemoveVolumes: true})
	if err != nil && !cerrdefs.IsNotFound(err) {
		return fmt.Errorf("remove container %s: %w", short(idOrName), err)
	}
	return nil
}

// LogTail returns the last n lines of combined output.
func (r *Runtime) LogTail(ctx context.Context, id string, n int) (string, error) {
	rc, err := r.c.ContainerLogs(ctx, id, container.LogsOptions{ShowStdout: true, ShowStderr: true, Tail: strconv.Itoa(n)})
	if err != nil {
		return "", fmt.Errorf("logs of %s: %w", short(id), err)
	}
	defer rc.Close()
	var out bytes.Buffer
	if _, err := stdcopy.StdCopy(&out, &out, io.LimitReader(rc, 1<<20)); err != nil && !errors.Is(err, io.EOF) {
		return "", fmt.Errorf("logs of %s: %w", short(id), err)
	}
	return strings.TrimRight(strings.ReplaceAll(out.String(), "\r\n", "\n"), "\n"), nil
}

func short(id string) string {
	if len(id) > 12 && !strings.ContainsAny(id, "-_.") {
		return id[:12]
	}
	return id
}
