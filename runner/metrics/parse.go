package metrics

import (
	"bytes"
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/tandem-run/tandem/api"
)

// The tools' answers are the job's image's to make up: each parser takes
// only numbers it can stand behind (a percent is 0-100, memory in use is
// within the total where the tool says the total, MiB that fit in bytes)
// and at most maxGPUs of them.

var errParse = errors.New("unexpected output")

// maxMiB is the largest MiB count whose bytes fit in a uint64.
const maxMiB = 1<<44 - 1

// parseNvidiaSMI reads nvidia-smi --query-gpu=memory.used,utilization.gpu
// --format=csv,noheader,nounits: "<MiB>, <percent>" a line. A line it
// cannot read is skipped, as it always was; one out of range too.
func parseNvidiaSMI(b []byte) ([]api.GPUMetrics, error) {
	out := []api.GPUMetrics{}
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Split(l, ",")
		if len(f) != 2 {
			continue
		}
		mib, err1 := parseDec(f[0])
		util, err2 := parsePercent(f[1])
		if err1 != nil || err2 != nil || mib > maxMiB {
			continue
		}
		if len(out) == maxGPUs {
			return nil, fmt.Errorf("%w: more than %d GPUs", errParse, maxGPUs)
		}
		out = append(out, api.GPUMetrics{GPUMemoryUsageBytes: mib << 20, GPUUtilPercent: util})
	}
	return out, nil
}

// parseAMDSMI reads amd-smi monitor -vu --csv, as dstack's runner runs it: a
// header naming the columns, then a row per GPU; "gfx" is the utilisation in
// percent, "vram_used" (and "vram_total", when there) MiB. Every row has the
// header's columns. A GPU whose numbers are N/A or out of range fails the
// whole answer (the caller then reads sysfs), as dstack drops it whole.
func parseAMDSMI(b []byte) ([]api.GPUMetrics, error) {
	r := csv.NewReader(bytes.NewReader(b))
	r.TrimLeadingSpace = true
	r.ReuseRecord = true
	header, err := r.Read()
	if err != nil {
		return nil, fmt.Errorf("%w: amd-smi header: %v", errParse, err)
	}
	col := map[string]int{"gfx": -1, "vram_used": -1, "vram_total": -1}
	for i, h := range header {
		h = strings.TrimSpace(h)
		if j, ok := col[h]; ok {
			if j >= 0 {
				return nil, fmt.Errorf("%w: amd-smi column %q twice", errParse, h)
			}
			col[h] = i
		}
	}
	if col["gfx"] < 0 || col["vram_used"] < 0 {
		return nil, fmt.Errorf("%w: amd-smi has no gfx or vram_used column", errParse)
	}
	out := []api.GPUMetrics{}
	for {
		rec, err := r.Read()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%w: amd-smi row %d: %v", errParse, len(out)+1, err)
		}
		if len(out) == maxGPUs {
			return nil, fmt.Errorf("%w: more than %d GPUs", errParse, maxGPUs)
		}
		util, err := parsePercent(rec[col["gfx"]])
		if err != nil {
			return nil, fmt.Errorf("%w: amd-smi gfx of GPU row %d: %v", errParse, len(out)+1, err)
		}
		used, err := parseDec(rec[col["vram_used"]])
		if err != nil || used > maxMiB {
			return nil, fmt.Errorf("%w: amd-smi vram_used of GPU row %d: %q", errParse, len(out)+1, rec[col["vram_used"]])
		}
		if i := col["vram_total"]; i >= 0 {
			total, err := parseDec(rec[i])
			if err != nil || used > total {
				return nil, fmt.Errorf("%w: amd-smi vram_total of GPU row %d: %q (used %d)", errParse, len(out)+1, rec[i], used)
			}
		}
		out = append(out, api.GPUMetrics{GPUMemoryUsageBytes: used << 20, GPUUtilPercent: util})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: amd-smi listed no GPU", errParse)
	}
	return out, nil
}

// parseHLSMI reads hl-smi --query-aip=memory.used,memory.total,
// utilization.aip --format=csv,noheader,nounits: "<MiB>, <MiB>, <percent>"
// a line (hl-smi may print the percent sign even with nounits). Every line
// must read, or the whole answer fails.
func parseHLSMI(b []byte) ([]api.GPUMetrics, error) {
	out := []api.GPUMetrics{}
	for n, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Split(l, ",")
		if len(f) != 3 {
			return nil, fmt.Errorf("%w: hl-smi line %d has %d fields, not 3", errParse, n+1, len(f))
		}
		used, err1 := parseDec(f[0])
		total, err2 := parseDec(f[1])
		util, err3 := parsePercent(strings.TrimSuffix(strings.TrimSpace(f[2]), "%"))
		if err := errors.Join(err1, err2, err3); err != nil || used > total || used > maxMiB {
			return nil, fmt.Errorf("%w: hl-smi line %d: %q", errParse, n+1, l)
		}
		if len(out) == maxGPUs {
			return nil, fmt.Errorf("%w: more than %d GPUs", errParse, maxGPUs)
		}
		out = append(out, api.GPUMetrics{GPUMemoryUsageBytes: used << 20, GPUUtilPercent: util})
	}
	return out, nil
}

// parseDec reads a decimal count: digits only (no sign, no "N/A"), spaces
// around it allowed.
func parseDec(s string) (uint64, error) {
	s = strings.TrimSpace(s)
	if s == "" || strings.TrimLeft(s, "0123456789") != "" {
		return 0, fmt.Errorf("%q is not a count", s)
	}
	return strconv.ParseUint(s, 10, 64)
}

func parsePercent(s string) (int, error) {
	n, err := parseDec(s)
	if err != nil {
		return 0, err
	}
	if n > 100 {
		return 0, fmt.Errorf("%d is not a percent", n)
	}
	return int(n), nil
}
