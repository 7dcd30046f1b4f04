// Whether the host can give the accelerators it has (the package doc is in
// gpu.go).

package gpu

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/tandem-run/tandem/api"
)

// Monitor watches whether the host can give its accelerators, at start and
// on every tick (Run), and answers /api/instance/health in DCGM's shape.
//
// A host whose device nodes are there but whose GPUs cannot be used (NVML
// fails, a card vanished since start, Docker has no way to hand NVIDIA GPUs
// to a container) reports a failure: the dstack server does not schedule
// onto an instance whose overall health is a failure, and a job started
// there would run with no GPU. A GPU whose own health turns critical is
// only taken out of allocation (Locks.Exclude), and the host stays
// schedulable as long as one GPU is left: its overall health is a warning.
type Monitor struct {
	DevRoot string                     // "/dev"; a fixture tree's under --host-root
	SysRoot string                     // "/sys", for what an AMD render node is
	GPUs    []GPU                      // discovered at start: what the host reports
	NVML    nvmlHealth                 // nil: no NVIDIA source
	XIDs    func() map[string][]uint64 // critical XIDs seen (NVML.WatchXIDs); nil: none
	Locks   *Locks
	// Access says how Docker hands NVIDIA GPUs to containers; nil: not
	// checked. An error (Docker down) leaves the previous answer: the
	// Docker check of the health answer says so itself.
	Access func(context.Context) (Access, error)
	Log    *slog.Logger

	mu         sync.Mutex // guards the fields below
	startNodes int        // NVIDIA GPU nodes at the first check (-1 before it)
	host       []api.DCGMIncident
	access     []api.DCGMIncident
	gpu        []api.DCGMIncident
	noneLeft   bool // every NVIDIA GPU is out of allocation
	checked    bool
	logged     string // the host problems last logged, to log each change once
}

// nvmlHealth is what the monitor asks NVML.
type nvmlHealth interface {
	Present() ([]string, error)
	Health(xids map[string][]uint64) *api.DCGMHealth
}

// Access is how the container runtime reaches NVIDIA GPUs.
type Access struct {
	Runtime bool     // Docker has the nvidia runtime
	CDI     bool     // GPUs go to containers as CDI devices
	CDIDirs []string // where Docker reads CDI specs
}

// Health system, result and entity values in DCGM's numbering, which the
// dstack server validates (results: api.HealthPass, HealthWarn, HealthFail).
const (
	healthPass, healthWarn, healthFail                  = api.HealthPass, api.HealthWarn, api.HealthFail
	systemMem, systemThermal, systemPower, systemDriver = 0x10, 0x80, 0x100, 0x200
	entityGPU                                           = 1
	// Error codes: ours, named after DCGM's failure reasons.
	codePendingRetirement, codeRowRemapPending, codeRowRemapFailure, codeUncorrectableECC = 1, 2, 3, 4
	codeThermalThrottle, codePowerBrake, codeXID, codeGPULost                             = 5, 6, 7, 8
)

// HealthInterval is how often the monitor checks: the dstack server asks
// for health at most once a minute, and a check is a directory read and a
// few NVML queries per GPU.
const HealthInterval = 30 * time.Second

// accessTimeout bounds the Docker question of one check.
const accessTimeout = 5 * time.Second

// amdMinVRAMMiB is AMD.Discover's default bound under which a card is an
// integrated GPU, not one the host reports.
const amdMinVRAMMiB = 4096

var nvidiaNode = regexp.MustCompile(`^nvidia([0-9]+)$`)

// Run checks on every tick until ctx ends.
func (m *Monitor) Run(ctx context.Context, ticks <-chan time.Time) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticks:
			m.Check(ctx)
		}
	}
}

// Check checks everything: the host (CheckHost), then Docker.
func (m *Monitor) Check(ctx context.Context) {
	m.CheckHost()
	if m.Access == nil || len(m.nvidia()) == 0 {
		return
	}
	actx, cancel := context.WithTimeout(ctx, accessTimeout)
	a, err := m.Access(actx)
	cancel()
	if err != nil {
		return
	}
	var out []api.DCGMIncident
	switch {
	case a.CDI:
		names, _ := CDIGPUNames(a.CDIDirs) // an unreadable spec is logged at start
		if missing := CDIMissing(m.nvidia(), names); len(missing) > 0 {
			out = append(out, hostIncident(fmt.Sprintf("Docker hands GPUs to containers as CDI devices, but no CDI spec in %s names %s, so a GPU task cannot start here. "+
				"On the host: %s (nvidia-container-toolkit), then check with: nvidia-ctk cdi list", strings.Join(a.CDIDirs, ", "), m.names(missing), CDIGenerate)))
		}
	case !a.Runtime:
		out = append(out, hostIncident("Docker has neither the NVIDIA runtime nor CDI, so a GPU task cannot start here. "+
			"Install nvidia-container-toolkit, then: nvidia-ctk runtime configure --runtime=docker && systemctl restart docker"))
	}
	m.mu.Lock()
	m.access = out
	m.mu.Unlock()
	m.logChange()
}

// CheckHost checks the device nodes, NVML and each GPU's health, without
// Docker, and takes a critical or vanished GPU out of allocation.
func (m *Monitor) CheckHost() {
	nodes := m.nvidiaNodes()
	nv := m.nvidia()
	m.mu.Lock()
	if !m.checked {
		m.startNodes = len(nodes)
	}
	startNodes := m.startNodes
	m.mu.Unlock()

	var host []api.DCGMIncident
	excluded := map[string]string{}
	var present []string
	var nvmlErr error
	if m.NVML != nil {
		present, nvmlErr = m.NVML.Present()
	}
	switch {
	case len(nodes) > 0 && len(nv) == 0 && nvmlErr != nil:
		host = append(host, hostIncident(fmt.Sprintf("this host has %s but NVML cannot use them (%v), so a GPU task would start with no GPU. "+
			"Check with nvidia-smi; load or reinstall the NVIDIA driver for this kernel (modprobe nvidia; dmesg | grep -i nvrm), then restart dstack-shim", nodeList(nodes), nvmlErr)))
	case len(nodes) > 0 && len(nv) == 0:
		host = append(host, hostIncident(fmt.Sprintf("this host has %s but the shim found no NVIDIA GPU at its start (NVML sees %d now), so a GPU task would start with no GPU. "+
			"Check with nvidia-smi, then restart dstack-shim", nodeList(nodes), len(present))))
	case len(nv) > 0 && nvmlErr != nil:
		host = append(host, hostIncident(fmt.Sprintf("NVML no longer answers (%v): the shim cannot tell which of its %d GPUs work. Check with nvidia-smi and dmesg", nvmlErr, len(nv))))
	case len(nv) > 0:
		for _, g := range nv {
			if !slices.Contains(present, g.ID) {
				why := fmt.Sprintf("GPU %d (%s) has vanished since the shim started: NVML no longer lists it. Check with nvidia-smi and dmesg; reset or reboot the host", g.Index, g.ID)
				host = append(host, gpuIncident(g.Index, why))
				excluded[g.ID] = why
			}
		}
		if len(nodes) > len(nv) {
			host = append(host, hostIncident(fmt.Sprintf("this host has %s but NVML gives %d GPUs, so a task asking for them all cannot start. "+
				"Check with nvidia-smi and dmesg, then restart dstack-shim", nodeList(nodes), len(nv))))
		}
	}
	if len(nv) > 0 && startNodes > 0 && len(nodes) < startNodes {
		host = append(host, hostIncident(fmt.Sprintf("%d NVIDIA GPU device nodes were there at the shim's start, %d are now: a card has vanished. Check with nvidia-smi and dmesg; reset or reboot the host", startNodes, len(nodes))))
	}
	host = append(host, m.amdProblems()...)

	// Each GPU's own health: a failure takes it out of allocation only.
	var gpuIncidents []api.DCGMIncident
	if m.NVML != nil && len(nv) > 0 && nvmlErr == nil {
		var xids map[string][]uint64
		if m.XIDs != nil {
			xids = m.XIDs()
		}
		if h := m.NVML.Health(xids); h != nil {
			for _, in := range h.Incidents {
				if in.Health == api.HealthFail && in.EntityGroupID == entityGPU {
					if g, ok := byIndex(nv, in.EntityID); ok {
						if excluded[g.ID] == "" {
							excluded[g.ID] = in.ErrorMessage
						}
						in.ErrorMessage += "; taken out of allocation: new tasks do not get it, a task holding it keeps it"
					}
				}
				gpuIncidents = append(gpuIncidents, in)
			}
		}
	}
	noneLeft := len(nv) > 0 && len(excluded) >= len(nv)
	if m.Locks != nil {
		added, restored := m.Locks.Exclude(excluded)
		for _, id := range added {
			m.log().Warn("GPU taken out of allocation", "gpu", id, "reason", excluded[id])
		}
		for _, id := range restored {
			m.log().Info("GPU back in allocation: its health no longer fails", "gpu", id)
		}
	}
	if noneLeft {
		host = append(host, hostIncident(fmt.Sprintf("all %d GPUs of this host are out of allocation (their incidents follow), so no GPU task can start here", len(nv))))
	}
	m.mu.Lock()
	m.host, m.gpu, m.noneLeft, m.checked = host, gpuIncidents, noneLeft, true
	m.mu.Unlock()
	m.logChange()
}

// Health is the last check's answer: nil (null, as dstack's shim answers
// without DCGM) on a host with neither accelerators nor problems; a
// failure first, so that the first incident (the message the server shows)
// is what keeps the host from GPU tasks.
func (m *Monitor) Health() *api.DCGMHealth {
	m.mu.Lock()
	defer m.mu.Unlock()
	hostSide := slices.Concat(m.host, m.access)
	if len(hostSide) == 0 && len(m.gpu) == 0 && len(m.nvidia()) == 0 {
		return nil
	}
	h := &api.DCGMHealth{OverallHealth: api.HealthPass, Incidents: slices.Concat(hostSide, m.gpu)}
	if h.Incidents == nil {
		h.Incidents = []api.DCGMIncident{}
	}
	switch {
	case len(hostSide) > 0 || m.noneLeft:
		h.OverallHealth = api.HealthFail
	case len(m.gpu) > 0:
		// A failing GPU is out of allocation and the others still serve:
		// the host is a warning, which the server still schedules onto.
		h.OverallHealth = api.HealthWarn
	}
	return h
}

// logChange logs the host's problems once per change.
func (m *Monitor) logChange() {
	m.mu.Lock()
	var msgs []string
	for _, in := range slices.Concat(m.host, m.access) {
		msgs = append(msgs, in.ErrorMessage)
	}
	now := strings.Join(msgs, "\n")
	changed := now != m.logged
	m.logged = now
	m.mu.Unlock()
	switch {
	case !changed:
	case now == "":
		m.log().Info("the host can give its GPUs again")
	default:
		m.log().Error("the host cannot give its GPUs: /api/instance/health reports it, so the dstack server schedules no job here", "problems", msgs)
	}
}

func (m *Monitor) log() *slog.Logger {
	if m.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return m.Log
}

func (m *Monitor) nvidia() []GPU {
	var out []GPU
	for _, g := range m.GPUs {
		if g.Vendor == api.GPUVendorNVIDIA {
			out = append(out, g)
		}
	}
	return out
}

// names is the GPUs with these ids as their indices say them.
func (m *Monitor) names(ids []string) string {
	var out []string
	for _, g := range m.GPUs {
		if slices.Contains(ids, g.ID) {
			out = append(out, fmt.Sprintf("GPU %d (%s)", g.Index, g.ID))
		}
	}
	return strings.Join(out, ", ")
}

// nvidiaNodes is the minor numbers of the NVIDIA GPU nodes (/dev/nvidiaN;
// not nvidiactl, nvidia-uvm or nvidia-caps). Only names are read: a node
// is never opened, and nothing is followed.
func (m *Monitor) nvidiaNodes() []int {
	entries, err := os.ReadDir(m.DevRoot)
	if err != nil {
		return nil
	}
	var out []int
	for _, e := range entries {
		if sub := nvidiaNode.FindStringSubmatch(e.Name()); sub != nil && !e.IsDir() {
			if n, err := strconv.Atoi(sub[1]); err == nil {
				out = append(out, n)
			}
		}
	}
	sort.Ints(out)
	return out
}

// amdProblems reports AMD render nodes that look like discrete GPUs (AMD's
// PCI vendor, VRAM at least an integrated GPU's or unreadable) beyond those
// the shim found, on a host with the compute driver's /dev/kfd. An APU's
// small VRAM reads as integrated: a CPU host with one is not a GPU host.
func (m *Monitor) amdProblems() []api.DCGMIncident {
	if _, err := os.Lstat(filepath.Join(m.DevRoot, "kfd")); err != nil {
		return nil
	}
	nodes, _ := filepath.Glob(filepath.Join(m.DevRoot, "dri", "renderD*"))
	var discrete []string
	for _, n := range nodes {
		dev := filepath.Join(m.SysRoot, "class", "drm", filepath.Base(n), "device")
		if readTrim(filepath.Join(dev, "vendor")) != "0x1002" {
			continue
		}
		vram, err := strconv.ParseInt(readTrim(filepath.Join(dev, "mem_info_vram_total")), 10, 64)
		if err == nil && vram>>20 < amdMinVRAMMiB {
			continue
		}
		discrete = append(discrete, "/dev/dri/"+filepath.Base(n))
	}
	found := 0
	for _, g := range m.GPUs {
		if g.Vendor == api.GPUVendorAMD {
			found++
		}
	}
	if len(discrete) <= found {
		return nil
	}
	return []api.DCGMIncident{hostIncident(fmt.Sprintf("this host has /dev/kfd and %d AMD GPU render nodes (%s) but the shim can use %d, so a GPU task would not get them. "+
		"Check that the amdgpu driver is loaded with its compute part (ls /sys/class/kfd; rocm-smi; dmesg | grep -i amdgpu), then restart dstack-shim",
		len(discrete), strings.Join(discrete, ", "), found))}
}

func nodeList(nodes []int) string {
	if len(nodes) == 1 {
		return fmt.Sprintf("an NVIDIA GPU device node (/dev/nvidia%d)", nodes[0])
	}
	return fmt.Sprintf("%d NVIDIA GPU device nodes (/dev/nvidia%d to /dev/nvidia%d)", len(nodes), nodes[0], nodes[len(nodes)-1])
}

func byIndex(gpus []GPU, index int) (GPU, bool) {
	for _, g := range gpus {
		if g.Index == index {
			return g, true
		}
	}
	return GPU{}, false
}

// hostIncident is a failure of the host's GPUs as a whole.
func hostIncident(msg string) api.DCGMIncident {
	return api.DCGMIncident{System: systemDriver, Health: api.HealthFail, ErrorMessage: msg}
}

// gpuIncident is a failure of one GPU.
func gpuIncident(index int, msg string) api.DCGMIncident {
	return api.DCGMIncident{System: systemDriver, Health: api.HealthFail, ErrorMessage: msg, EntityGroupID: entityGPU, EntityID: index}
}
