package gpu

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Exporter proxies a dcgm-exporter running on the host, as dstack's shim
// does: fetched at most once per interval, filtered to a task's GPUs.
type Exporter struct {
	URL      string // http://localhost:10997/metrics
	Interval time.Duration
	HTTP     *http.Client
	Now      func() time.Time

	mu   sync.Mutex // guards body, at
	body string
	at   time.Time
}

// Fetch returns the exporter's text, cached for Interval; errors are not
// cached.
func (e *Exporter) Fetch(ctx context.Context) (string, error) {
	now := time.Now
	if e.Now != nil {
		now = e.Now
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.body != "" && now().Sub(e.at) < e.Interval {
		return e.body, nil
	}
	hc := e.HTTP
	if hc == nil {
		hc = &http.Client{Timeout: 10 * time.Second}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.URL, nil)
	if err != nil {
		return "", err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return "", fmt.Errorf("dcgm-exporter: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("dcgm-exporter: %s", resp.Status)
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return "", fmt.Errorf("dcgm-exporter: %w", err)
	}
	e.body, e.at = string(b), now()
	return e.body, nil
}

// FilterExposition keeps the samples that mention one of ids (the UUID
// label), each preceded once by its pending HELP and TYPE lines; other
// comments and blank lines are dropped.
func FilterExposition(text string, ids []string) string {
	if len(ids) == 0 {
		return ""
	}
	var b strings.Builder
	var help, typ string
	for _, line := range strings.Split(text, "\n") {
		switch {
		case strings.TrimSpace(line) == "":
		case strings.HasPrefix(line, "# HELP "):
			help, typ = line, ""
		case strings.HasPrefix(line, "# TYPE "):
			typ = line
		case strings.HasPrefix(line, "#"):
		default:
			for _, id := range ids {
				if strings.Contains(line, id) {
					if help != "" {
						b.WriteString(help + "\n")
						help = ""
					}
					if typ != "" {
						b.WriteString(typ + "\n")
						typ = ""
					}
					b.WriteString(line + "\n")
					break
				}
			}
		}
	}
	return b.String()
}
