package task

// Validation at the door and what makes two submits the same.

import (
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/ident"
)

// normalize fills dstack's defaults so that equal requests compare equal.
func normalize(c api.TaskConfig) api.TaskConfig {
	if c.ContainerUser == "" {
		c.ContainerUser = "root"
	}
	if c.NetworkMode == "" {
		c.NetworkMode = "host"
	}
	emptyNil := func(v any) {
		rv := reflect.ValueOf(v).Elem()
		if rv.Len() == 0 {
			rv.Set(reflect.Zero(rv.Type()))
		}
	}
	emptyNil(&c.Volumes)
	emptyNil(&c.VolumeMounts)
	emptyNil(&c.InstanceMounts)
	emptyNil(&c.GPUDevices)
	emptyNil(&c.HostSSHKeys)
	emptyNil(&c.ContainerSSHKeys)
	return c
}

func validate(c api.TaskConfig) error {
	switch { // dstack's own texts for the empty cases
	case c.ID == "":
		return fmt.Errorf("%w: empty id", ErrInvalid)
	case c.Name == "":
		return fmt.Errorf("%w: empty name", ErrInvalid)
	}
	if err := ident.TaskID(c.ID); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if err := ident.TaskName(c.Name); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	switch {
	case c.ImageName == "":
		return fmt.Errorf("%w: empty image_name", ErrInvalid)
	case c.GPU < -1:
		return fmt.Errorf("%w: gpu must be -1, 0 or a positive count, got %d", ErrInvalid, c.GPU)
	case c.CPU < 0 || c.Memory < 0 || c.ShmSize < 0:
		return fmt.Errorf("%w: cpu, memory and shm_size must not be negative", ErrInvalid)
	case c.PidsLimit < 0 || c.PidsLimit > MaxPidsLimit:
		return fmt.Errorf("%w: tandem_pids_limit must be between 1 and %d (0: the shim's)", ErrInvalid, MaxPidsLimit)
	}
	switch c.NetworkMode {
	case "", "host", "bridge":
	default:
		// Anything else reaches Docker as is: "container:<another task>"
		// would join that task's network namespace.
		return fmt.Errorf("%w: network_mode %s: want host or bridge", ErrInvalid, strconv.Quote(c.NetworkMode))
	}
	if _, _, err := imageRef(c.ImageName); err != nil {
		q := strconv.Quote(c.ImageName)
		if len(q) > 80 {
			q = q[:77] + "..."
		}
		// Docker's reference grammar (what `docker pull` accepts). Names
		// reach people's terminals through every client that lists tasks,
		// so control characters and the rest are refused at the door.
		return fmt.Errorf("%w: image_name %s is not a valid image reference: %v", ErrInvalid, q, errors.Unwrap(err))
	}
	for i, v := range c.Volumes {
		if err := ident.VolumeName(v.Name); err != nil {
			return fmt.Errorf("%w: volumes[%d]: %v", ErrInvalid, i, err)
		}
	}
	for i, v := range c.VolumeMounts {
		if err := ident.VolumeName(v.Name); err != nil {
			return fmt.Errorf("%w: volume_mounts[%d]: %v", ErrInvalid, i, err)
		}
		if !filepath.IsAbs(v.Path) {
			return fmt.Errorf("%w: volume_mounts[%d]: path %q must be absolute", ErrInvalid, i, v.Path)
		}
	}
	return nil
}

// sameSubmit says whether cfg repeats t's submit. A task restored from its
// record has no registry password, only its hash: the rest must be equal
// and the password must match the hash.
func sameSubmit(t *task, cfg api.TaskConfig) bool {
	if reflect.DeepEqual(t.cfg, cfg) {
		return true
	}
	if t.cfg.RegistryPassword != "" || t.pwHash == "" {
		return false
	}
	bare := cfg
	bare.RegistryPassword = ""
	return reflect.DeepEqual(t.cfg, bare) && passwordMatches(t.pwHash, cfg.RegistryPassword)
}

// MaxPublished is how many ports one task may publish.
const MaxPublished = 256

// validatePublish checks a task's tandem_publish, all of it here: bridge
// network only (a host-network job's ports are the host's already), at
// most MaxPublished, ports in range, tcp or udp, a host address that
// parses, and never one of runnerPorts (the runner's HTTP API takes no
// token: published on the host it would be anyone's way into the job).
func validatePublish(c api.TaskConfig, runnerPorts []int) error {
	if len(c.Publish) == 0 {
		return nil
	}
	if c.NetworkMode != "bridge" {
		return fmt.Errorf("%w: tandem_publish needs network_mode bridge (a host-network job's ports are the host's already), got %s", ErrInvalid, strconv.Quote(c.NetworkMode))
	}
	if len(c.Publish) > MaxPublished {
		return fmt.Errorf("%w: tandem_publish: %d ports, at most %d", ErrInvalid, len(c.Publish), MaxPublished)
	}
	for i, p := range c.Publish {
		switch {
		case p.ContainerPort < 1 || p.ContainerPort > 65535:
			return fmt.Errorf("%w: tandem_publish[%d]: container_port %d is not a port (1-65535)", ErrInvalid, i, p.ContainerPort)
		case p.HostPort < 0 || p.HostPort > 65535:
			return fmt.Errorf("%w: tandem_publish[%d]: host_port %d is not a port (1-65535, 0: any)", ErrInvalid, i, p.HostPort)
		case p.Proto() != "tcp" && p.Proto() != "udp":
			return fmt.Errorf("%w: tandem_publish[%d]: protocol %s: want tcp or udp", ErrInvalid, i, strconv.Quote(api.Printable(p.Protocol)))
		}
		if p.HostIP != "" {
			if _, err := netip.ParseAddr(p.HostIP); err != nil {
				return fmt.Errorf("%w: tandem_publish[%d]: host_ip %s is not an IP address", ErrInvalid, i, strconv.Quote(api.Printable(p.HostIP)))
			}
		}
		if isRunnerPort(p, runnerPorts) {
			return fmt.Errorf("%w: tandem_publish[%d]: container port %d is the runner's (its API and SSH server), never published", ErrInvalid, i, p.ContainerPort)
		}
	}
	return nil
}

// isRunnerPort says whether p is one of the runner's (TCP) ports.
func isRunnerPort(p api.PublishedPort, runnerPorts []int) bool {
	return p.Proto() == "tcp" && slices.Contains(runnerPorts, p.ContainerPort)
}
