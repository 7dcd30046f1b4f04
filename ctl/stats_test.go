package ctl

import (
	"math"
	"testing"

	"github.com/tandem-run/tandem/api"
)

func TestCPUPercent(t *testing.T) {
	at := func(ts int64, cpu uint64) api.MetricsResponse {
		return api.MetricsResponse{TimestampMicro: ts, CPUUsageMicro: cpu}
	}
	for _, tc := range []struct {
		name      string
		prev, cur api.MetricsResponse
		want      float64
		ok        bool
	}{
		{"one core busy", at(1_000_000, 5_000_000), at(3_000_000, 7_000_000), 100, true},
		{"two and a half cores", at(0, 0), at(1_000_000, 2_500_000), 250, true},
		{"idle", at(0, 42), at(2_000_000, 42), 0, true},
		{"same sample time", at(5, 1), at(5, 9), 0, false},
		{"time went back", at(9, 1), at(5, 9), 0, false},
		{"counter went back (a new container)", at(0, 9_000_000), at(1_000_000, 10), 0, false},
	} {
		got, ok := CPUPercent(tc.prev, tc.cur)
		if ok != tc.ok || math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("%s: %v %v, want %v %v", tc.name, got, ok, tc.want, tc.ok)
		}
	}
}
