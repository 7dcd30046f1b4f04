//go:build cgo

package gpu

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/tandem-run/tandem/api"
)

// NVML discovers NVIDIA GPUs through the driver's NVML library and reads
// their health and metrics with handles cached after one Init.
type NVML struct {
	Lib     nvml.Interface // nvml.New() in production; go-nvml's mock in tests
	SysRoot string         // for NUMA nodes: /sys

	mu      sync.Mutex // guards the fields below
	inited  bool
	initErr error
	devices map[string]nvml.Device // by UUID
	index   map[string]int
}

// NewNVML returns the NVML source backed by libnvidia-ml (loaded at Init):
// the loader's, or WSL's own on a WSL2 guest (nvmlLibrary).
func NewNVML() *NVML {
	if lib := nvmlLibrary("/"); lib != "" {
		return &NVML{Lib: nvml.New(nvml.WithLibraryPath(lib)), SysRoot: "/sys"}
	}
	return &NVML{Lib: nvml.New(), SysRoot: "/sys"}
}

// Vendor implements Source.
func (n *NVML) Vendor() api.GPUVendor { return api.GPUVendorNVIDIA }

func (n *NVML) init() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.inited {
		return n.initErr
	}
	n.inited = true
	switch ret := guard(func() nvml.Return { return n.Lib.Init() }); ret {
	case nvml.SUCCESS:
	case nvml.ERROR_LIBRARY_NOT_FOUND:
		n.initErr = fmt.Errorf("%w: libnvidia-ml.so.1 not found (no NVIDIA driver installed)", ErrNotPresent)
	case nvml.ERROR_DRIVER_NOT_LOADED:
		n.initErr = fmt.Errorf("%w: the NVIDIA kernel driver is not loaded", ErrNotPresent)
	case nvml.ERROR_NO_PERMISSION:
		n.initErr = fmt.Errorf("%w: no permission to open the NVIDIA devices", ErrNotPresent)
	default:
		n.initErr = fmt.Errorf("NVML init: %s", nvml.ErrorString(ret))
	}
	return n.initErr
}

// guard turns a panic (an NVML mock without that call, or a broken
// binding) into an error return: one failing query never fails the rest.
func guard(f func() nvml.Return) (ret nvml.Return) {
	defer func() {
		if recover() != nil {
			ret = nvml.ERROR_NOT_SUPPORTED
		}
	}()
	return f()
}

func busID(p nvml.PciInfo) string {
	var b strings.Builder
	for _, c := range p.BusId {
		if c == 0 {
			break
		}
		b.WriteByte(byte(c))
	}
	return strings.ToLower(b.String())
}

// Discover implements Source.
func (n *NVML) Discover(context.Context) ([]GPU, error) {
	if err := n.init(); err != nil {
		return nil, err
	}
	var count int
	if ret := guard(func() (r nvml.Return) { count, r = n.Lib.DeviceGetCount(); return }); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("NVML device count: %s", nvml.ErrorString(ret))
	}
	if count == 0 {
		return nil, fmt.Errorf("%w: NVML sees no devices", ErrNotPresent)
	}
	var driver string
	_ = guard(func() (r nvml.Return) { driver, r = n.Lib.SystemGetDriverVersion(); return })
	devices, index := map[string]nvml.Device{}, map[string]int{}
	out := make([]GPU, 0, count)
	for i := 0; i < count; i++ {
		var d nvml.Device
		if ret := guard(func() (r nvml.Return) { d, r = n.Lib.DeviceGetHandleByIndex(i); return }); ret != nvml.SUCCESS {
			return nil, fmt.Errorf("NVML device %d: %s", i, nvml.ErrorString(ret))
		}
		g := GPU{Vendor: api.GPUVendorNVIDIA, Index: i, DriverVersion: normalizeVersion(driver), NUMANode: -1}
		if ret := guard(func() (r nvml.Return) { g.ID, r = d.GetUUID(); return }); ret != nvml.SUCCESS {
			return nil, fmt.Errorf("NVML device %d uuid: %s", i, nvml.ErrorString(ret))
		}
		_ = guard(func() (r nvml.Return) { g.Name, r = d.GetName(); return })
		_ = guard(func() nvml.Return { m, r := d.GetMemoryInfo(); g.MemoryMiB = int64(m.Total >> 20); return r })
		_ = guard(func() nvml.Return { p, r := d.GetPciInfo(); g.PCIBusID = busID(p); return r })
		_ = guard(func() nvml.Return {
			cur, _, r := d.GetMigMode()
			g.MIGEnabled = cur == nvml.DEVICE_MIG_ENABLE
			return r
		})
		if g.PCIBusID != "" {
			if v, err := strconv.Atoi(readTrim(n.SysRoot + "/bus/pci/devices/" + pciSysName(g.PCIBusID) + "/numa_node")); err == nil {
				g.NUMANode = v
			}
		}
		devices[g.ID], index[g.ID] = d, i
		out = append(out, g)
	}
	n.mu.Lock()
	n.devices, n.index = devices, index
	n.mu.Unlock()
	return out, nil
}

// pciSysName turns NVML's 00000000:3B:00.0 into sysfs's 0000:3b:00.0.
func pciSysName(id string) string {
	if dom, rest, ok := strings.Cut(id, ":"); ok && len(dom) == 8 {
		return strings.ToLower(dom[4:] + ":" + rest)
	}
	return strings.ToLower(id)
}

func normalizeVersion(v string) string {
	switch strings.TrimSpace(v) {
	case "", "N/A", "[Not Supported]", "unknown":
		return ""
	}
	return strings.TrimSpace(v)
}

// criticalXIDs fail a GPU: ECC double-bit (48), row remap (63, 64), NVLink
// (74), fallen off the bus (79), contained/uncontained ECC (94, 95).
var criticalXIDs = map[uint64]string{48: "double-bit ECC error", 63: "row remap pending", 64: "row remap failure",
	74: "NVLink error", 79: "GPU has fallen off the bus", 94: "contained ECC error", 95: "uncontained ECC error"}

// Health reads NVML health signals into DCGM's shape; xids are recent XID
// events per GPU UUID (from WatchXIDs). nil when NVML is not in use.
func (n *NVML) Health(xids map[string][]uint64) *api.DCGMHealth {
	n.mu.Lock()
	devices, index := n.devices, n.index
	n.mu.Unlock()
	if devices == nil {
		return nil
	}
	h := &api.DCGMHealth{OverallHealth: healthPass, Incidents: []api.DCGMIncident{}}
	add := func(uuid string, system, health, code int, msg string) {
		h.Incidents = append(h.Incidents, api.DCGMIncident{System: system, Health: health, ErrorMessage: fmt.Sprintf("GPU %d: %s", index[uuid], msg),
			ErrorCode: code, EntityGroupID: entityGPU, EntityID: index[uuid]})
		h.OverallHealth = max(h.OverallHealth, health)
	}
	for _, uuid := range sortedKeys(index) {
		d := devices[uuid]
		// A GPU that fell off the bus answers every query with GPU_IS_LOST
		// (and may never raise XID 79 where the watcher hears it).
		lost := false
		query := func(f func() nvml.Return) nvml.Return {
			r := guard(f)
			if r == nvml.ERROR_GPU_IS_LOST && !lost {
				lost = true
				add(uuid, systemDriver, healthFail, codeGPULost, "GPU has fallen off the bus (NVML: GPU is lost)")
			}
			return r
		}
		if ret := query(func() nvml.Return {
			st, r := d.GetRetiredPagesPendingStatus()
			if r == nvml.SUCCESS && st == nvml.FEATURE_ENABLED {
				add(uuid, systemMem, healthWarn, codePendingRetirement, "retired pages pending a reset")
			}
			return r
		}); ret != nvml.SUCCESS && ret != nvml.ERROR_NOT_SUPPORTED && ret != nvml.ERROR_GPU_IS_LOST {
			add(uuid, systemDriver, healthWarn, 0, "cannot read retired pages: "+nvml.ErrorString(ret))
		}
		_ = query(func() nvml.Return {
			_, _, pending, failed, r := d.GetRemappedRows()
			if r != nvml.SUCCESS {
				return r
			}
			if failed {
				add(uuid, systemMem, healthFail, codeRowRemapFailure, "row remapping failed")
			} else if pending {
				add(uuid, systemMem, healthWarn, codeRowRemapPending, "row remapping pending a reset")
			}
			return r
		})
		_ = query(func() nvml.Return {
			c, r := d.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC)
			if r == nvml.SUCCESS && c > 0 {
				add(uuid, systemMem, healthFail, codeUncorrectableECC, fmt.Sprintf("%d uncorrectable ECC errors since boot", c))
			}
			return r
		})
		_ = query(func() nvml.Return {
			reasons, r := d.GetCurrentClocksEventReasons()
			if r != nvml.SUCCESS {
				return r
			}
			if reasons&(nvml.ClocksThrottleReasonHwThermalSlowdown|nvml.ClocksEventReasonSwThermalSlowdown) != 0 {
				add(uuid, systemThermal, healthWarn, codeThermalThrottle, "clocks throttled by temperature")
			}
			if reasons&nvml.ClocksThrottleReasonHwPowerBrakeSlowdown != 0 {
				add(uuid, systemPower, healthWarn, codePowerBrake, "clocks throttled by power brake")
			}
			return r
		})
		for _, x := range xids[uuid] {
			if what, ok := criticalXIDs[x]; ok {
				add(uuid, systemDriver, healthFail, codeXID, fmt.Sprintf("XID %d: %s", x, what))
			}
		}
	}
	return h
}

// Present enumerates the GPUs NVML sees now, by index (their UUIDs),
// without touching the handles Discover cached: how the health monitor
// tells that a card vanished since start. The error is Init's when NVML
// could not start.
func (n *NVML) Present() ([]string, error) {
	if err := n.init(); err != nil {
		return nil, err
	}
	var count int
	if ret := guard(func() (r nvml.Return) { count, r = n.Lib.DeviceGetCount(); return }); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("NVML device count: %s", nvml.ErrorString(ret))
	}
	out := make([]string, 0, count)
	for i := 0; i < count; i++ {
		var uuid string
		ret := guard(func() nvml.Return {
			d, r := n.Lib.DeviceGetHandleByIndex(i)
			if r != nvml.SUCCESS {
				return r
			}
			uuid, r = d.GetUUID()
			return r
		})
		if ret == nvml.SUCCESS {
			out = append(out, uuid)
		}
	}
	return out, nil
}

// maxXIDsPerGPU bounds the distinct XIDs remembered per GPU (the driver
// defines about 150).
const maxXIDsPerGPU = 64

// WatchXIDs records critical XID events until ctx ends; the returned func
// reports the events seen so far per GPU UUID.
func (n *NVML) WatchXIDs(ctx context.Context) func() map[string][]uint64 {
	var mu sync.Mutex
	seen := map[string][]uint64{}
	report := func() map[string][]uint64 {
		mu.Lock()
		defer mu.Unlock()
		out := make(map[string][]uint64, len(seen))
		for k, v := range seen {
			out[k] = append([]uint64(nil), v...)
		}
		return out
	}
	n.mu.Lock()
	devices := n.devices
	n.mu.Unlock()
	var set nvml.EventSet
	if ret := guard(func() (r nvml.Return) { set, r = n.Lib.EventSetCreate(); return }); ret != nvml.SUCCESS || devices == nil {
		return report
	}
	registered := 0
	for _, d := range devices {
		if guard(func() nvml.Return { return d.RegisterEvents(nvml.EventTypeXidCriticalError, set) }) == nvml.SUCCESS {
			registered++
		}
	}
	if registered == 0 {
		return report
	}
	go func() {
		defer guard(func() nvml.Return { return set.Free() })
		for ctx.Err() == nil {
			var ev nvml.EventData
			if guard(func() (r nvml.Return) { ev, r = set.Wait(1000); return }) != nvml.SUCCESS {
				continue
			}
			var uuid string
			_ = guard(func() (r nvml.Return) { uuid, r = ev.Device.GetUUID(); return })
			// Each XID is kept once per GPU, and at most maxXIDsPerGPU of
			// them: a job that makes its GPU fault in a loop (XID 13, 31)
			// raises an event each time, and must not grow this.
			mu.Lock()
			if l := seen[uuid]; !slices.Contains(l, ev.EventData) && len(l) < maxXIDsPerGPU {
				seen[uuid] = append(l, ev.EventData)
			}
			mu.Unlock()
		}
	}()
	return report
}

// Metrics renders Prometheus text for the given GPUs, DCGM field names and
// a UUID label, reading NVML at most once per interval.
type Metrics struct {
	NVML     *NVML
	Interval time.Duration
	Now      func() time.Time

	mu    sync.Mutex // guards cache
	at    time.Time
	cache map[string]gpuSample
}

type gpuSample struct {
	index                             int
	name                              string
	util, memUsedMiB, memTotalMiB     float64
	powerW, tempC, smClockMHz         float64
	eccCorrected, eccUncorrected      float64
	hasUtil, hasMem, hasPower, hasTmp bool
	hasClock, hasECC                  bool
}

func (m *Metrics) sample() map[string]gpuSample {
	now := time.Now
	if m.Now != nil {
		now = m.Now
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cache != nil && now().Sub(m.at) < m.Interval {
		return m.cache
	}
	m.NVML.mu.Lock()
	devices, index := m.NVML.devices, m.NVML.index
	m.NVML.mu.Unlock()
	out := make(map[string]gpuSample, len(devices))
	for uuid, d := range devices {
		s := gpuSample{index: index[uuid]}
		_ = guard(func() (r nvml.Return) { s.name, r = d.GetName(); return })
		s.hasUtil = guard(func() nvml.Return { u, r := d.GetUtilizationRates(); s.util = float64(u.Gpu); return r }) == nvml.SUCCESS
		s.hasMem = guard(func() nvml.Return {
			mi, r := d.GetMemoryInfo()
			s.memUsedMiB, s.memTotalMiB = float64(mi.Used>>20), float64(mi.Total>>20)
			return r
		}) == nvml.SUCCESS
		s.hasPower = guard(func() nvml.Return { p, r := d.GetPowerUsage(); s.powerW = float64(p) / 1000; return r }) == nvml.SUCCESS
		s.hasTmp = guard(func() nvml.Return { t, r := d.GetTemperature(nvml.TEMPERATURE_GPU); s.tempC = float64(t); return r }) == nvml.SUCCESS
		s.hasClock = guard(func() nvml.Return { c, r := d.GetClockInfo(nvml.CLOCK_SM); s.smClockMHz = float64(c); return r }) == nvml.SUCCESS
		s.hasECC = guard(func() nvml.Return {
			c, r := d.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_CORRECTED, nvml.VOLATILE_ECC)
			if r != nvml.SUCCESS {
				return r
			}
			u, r := d.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC)
			s.eccCorrected, s.eccUncorrected = float64(c), float64(u)
			return r
		}) == nvml.SUCCESS
		out[uuid] = s
	}
	m.cache, m.at = out, now()
	return out
}

// Text returns the exposition text for the GPUs with these UUIDs.
func (m *Metrics) Text(uuids []string) string {
	if len(uuids) == 0 {
		return ""
	}
	samples := m.sample()
	type field struct {
		name, help, typ string
		get             func(gpuSample) (float64, bool)
	}
	fields := []field{
		{"DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "gauge", func(s gpuSample) (float64, bool) { return s.util, s.hasUtil }},
		{"DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "gauge", func(s gpuSample) (float64, bool) { return s.memUsedMiB, s.hasMem }},
		{"DCGM_FI_DEV_FB_TOTAL", "Framebuffer memory total (in MiB).", "gauge", func(s gpuSample) (float64, bool) { return s.memTotalMiB, s.hasMem }},
		{"DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "gauge", func(s gpuSample) (float64, bool) { return s.powerW, s.hasPower }},
		{"DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "gauge", func(s gpuSample) (float64, bool) { return s.tempC, s.hasTmp }},
		{"DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "gauge", func(s gpuSample) (float64, bool) { return s.smClockMHz, s.hasClock }},
		{"DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors.", "counter", func(s gpuSample) (float64, bool) { return s.eccCorrected, s.hasECC }},
		{"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors.", "counter", func(s gpuSample) (float64, bool) { return s.eccUncorrected, s.hasECC }},
	}
	var b strings.Builder
	for _, f := range fields {
		header := false
		for _, uuid := range uuids {
			s, ok := samples[uuid]
			if !ok {
				continue
			}
			v, ok := f.get(s)
			if !ok {
				continue
			}
			if !header {
				fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s %s\n", f.name, f.help, f.name, f.typ)
				header = true
			}
			fmt.Fprintf(&b, "%s{gpu=\"%d\",UUID=\"%s\",device=\"nvidia%d\",modelName=%q} %s\n", f.name, s.index, uuid, s.index, s.name,
				strconv.FormatFloat(v, 'f', -1, 64))
		}
	}
	return b.String()
}
