package api

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

var update = flag.Bool("update", false, "rewrite golden files in testdata/")

func ptr[T any](v T) *T { return &v }

// goldenCases holds one representative value of every wire type. Each is
// encoded and compared with testdata/<name>.json, and the golden file is
// decoded back and must re-encode to the same bytes.
func goldenCases() []struct {
	name  string
	value any
} {
	exit0, exit3 := 0, 3
	return []struct {
		name  string
		value any
	}{
		{"shim_healthcheck", HealthcheckResponse{Service: ServiceShim, Version: "0.21.2+tandem.0.1.0"}},
		{"shim_shutdown_request", ShutdownRequest{Force: true}},
		{"instance_health_null", InstanceHealthResponse{}},
		{"instance_health_dcgm", InstanceHealthResponse{DCGM: &DCGMHealth{OverallHealth: 10, Incidents: []DCGMIncident{{
			System: 4, Health: 10, ErrorMessage: "GPU 0 has 2 retired pages", ErrorCode: 24, EntityGroupID: 1, EntityID: 0,
		}}}}},
		{"instance_info_empty", InstanceInfoResponse{}},
		{"instance_info_nvidia", InstanceInfoResponse{GPUVendor: GPUVendorNVIDIA, GPUDriverVersion: "570.86.15"}},
		{"components", ComponentListResponse{Components: []ComponentInfo{
			{Name: ComponentRunner, Version: "0.21.2+tandem.0.1.0", Status: ComponentInstalled},
			{Name: ComponentShim, Version: "", Status: ComponentInstalling},
		}}},
		{"component_install_request", ComponentInstallRequest{Name: ComponentRunner, URL: "https://example.com/0.21.2/binaries/dstack-runner-linux-amd64"}},
		{"task_config", TaskConfig{
			ID: "b4c0ffee-0000-4000-8000-000000000001", Name: "horrible-mule-1-0-0", ImageName: "dstackai/base:py3.12-0.7-cuda-12.1",
			RegistryUsername: "", RegistryPassword: "", ContainerUser: "root", Privileged: false,
			GPU: 2, CPU: 7.5, Memory: 64 << 30, ShmSize: 16 << 30, NetworkMode: "host",
			Volumes:        []VolumeInfo{{Backend: "aws", Name: "data", VolumeID: "vol-0abc123", InitFS: true, DeviceName: "/dev/sdf"}},
			VolumeMounts:   []VolumeMountPoint{{Name: "data", Path: "/data"}},
			InstanceMounts: []InstanceMountPoint{{InstancePath: "/mnt/cache", Path: "/cache"}},
			GPUDevices:     []GPUDevice{{PathOnHost: "/dev/nvidia0", PathInContainer: "/dev/nvidia0"}},
			HostSSHUser:    "ubuntu", HostSSHKeys: []string{"ssh-ed25519 AAAAuser user"},
			ContainerSSHKeys: []string{"ssh-rsa AAAAproject project", "ssh-ed25519 AAAAuser user"},
		}},
		{"task_info_pending", TaskInfoResponse{ID: "t1", Status: TaskPending, ContainerName: "horrible-mule-1-0-0-44f7cb95"}},
		{"task_info_pulling", TaskInfoResponse{ID: "t1", Status: TaskPulling, ContainerName: "horrible-mule-1-0-0-44f7cb95",
			ImagePullProgress: &ImagePullProgress{DownloadedBytes: 1 << 20, ExtractedBytes: 0, TotalBytes: 3 << 20, IsTotalBytesFinal: false},
			GPUIDs:            []string{}}},
		{"task_info_running_host", TaskInfoResponse{ID: "t1", Status: TaskRunning, Ports: []PortMapping{},
			ContainerName: "horrible-mule-1-0-0-44f7cb95", ContainerID: "3f2a9c", GPUIDs: []string{"GPU-7d1e9f2a-0000-0000-0000-000000000000"}}},
		{"task_info_running_bridge", TaskInfoResponse{ID: "t1", Status: TaskRunning,
			Ports: []PortMapping{{Host: 32768, Container: 10999}, {Host: 32769, Container: 10022}}, GPUIDs: []string{}}},
		{"task_info_terminated", TaskInfoResponse{ID: "t1", Status: TaskTerminated, TerminationReason: ReasonContainerExitedWithError,
			TerminationMessage: "line 4\nline 5", Ports: []PortMapping{}, GPUIDs: []string{}}},
		{"task_submit_response", TaskInfoResponse{ID: "t1", Status: TaskPending, ContainerName: "horrible-mule-1-0-0-44f7cb95"}.SubmitResponse()},
		{"task_image_config", TaskImageConfig{Image: "sha256:4f1c6a0e0000000000000000000000000000000000000000000000000000beef",
			Entrypoint: []string{"/bin/sh", "-c"}, Cmd: []string{"echo hello from CMD; exit 3"}, WorkingDir: "/srv",
			Env: []string{"PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=hi"}, User: "1000:1000"}},
		{"task_image_config_empty", TaskImageConfig{Image: "sha256:0d0c", Entrypoint: []string{}, Cmd: []string{}, Env: []string{}}},
		{"task_list", TaskListResponse{Tasks: []TaskListItem{{ID: "t1", Status: TaskRunning}, {ID: "t2", Status: TaskTerminated}}}},
		{"task_list_empty", TaskListResponse{Tasks: []TaskListItem{}}},
		{"task_terminate_request", TaskTerminateRequest{TerminationReason: ReasonTerminatedByUser, TerminationMessage: "stopped", Timeout: 10}},
		{"host_info", HostInfo{GPUVendor: GPUVendorNVIDIA, GPUName: "A100-SXM4-80GB", GPUMemory: 81920, GPUCount: 8,
			Addresses: []string{"10.0.0.5/24", "fe80::1/64"}, DiskSize: 100 << 30, CPUs: 96, Memory: 1 << 40}},
		{"legacy_submit_request", LegacySubmitRequest{ImageName: "ubuntu:22.04", ContainerName: "c", ContainerUser: "root",
			PublicKeys: []string{"ssh-ed25519 AAAA k"}, SSHUser: "ubuntu", SSHKey: "ssh-ed25519 AAAA k"}},
		{"legacy_pull_response", LegacyPullResponse{State: "pending", Result: LegacyJobResult{Reason: "executor_error", ReasonMessage: "boom"}}},
		{"legacy_stop_request", LegacyStopRequest{Force: true}},
		{"legacy_stop_response", LegacyStopResponse{State: "pending"}},

		{"runner_healthcheck", HealthcheckResponse{Service: ServiceRunner, Version: "0.21.2+tandem.0.1.0"}},
		{"runner_submit", SubmitBody{
			Run: Run{ID: "run-1", RunSpec: RunSpec{RunName: "horrible-mule-1", RepoID: "repo-1",
				RepoData:      &RepoData{RepoType: RepoVirtual},
				Configuration: RunConfiguration{Raw: json.RawMessage(`{"type":"task","commands":["echo hi"]}`)}, ConfigurationPath: ".dstack.yml"}},
			JobSpec: JobSpec{ReplicaNum: 0, JobNum: 0, JobsPerReplica: 1,
				User:     &JobUser{UID: ptr(1000), GID: nil, Username: ptr("user"), Groupname: nil},
				Commands: []string{"/bin/sh", "-i", "-c", "echo hi"}, Env: map[string]string{"A": "1"},
				SingleBranch: true, MaxDuration: 3600, SSHKey: &SSHKey{Private: "-----BEGIN-----", Public: "ssh-ed25519 AAAA"},
				WorkingDir: ptr("~/work"), RepoDir: ptr("/workflow"), RepoData: &RepoData{RepoType: RepoRemote, RepoName: "r",
					RepoBranch: "main", RepoHash: "abc123", RepoConfigName: "A", RepoConfigEmail: "a@b"},
				RepoExistsAction: "skip", FileArchives: []FileArchive{{ID: "5b7a0f2e-0000-4000-8000-000000000000", Path: "~/data"}}},
			JobSubmission:   JobSubmission{ID: "sub-1"},
			ClusterInfo:     ClusterInfo{JobIPs: []string{"10.0.0.1", "10.0.0.2"}, MasterJobIP: "10.0.0.1", GPUsPerJob: 8, GPUsPerNode: []int{8, 8}},
			Secrets:         map[string]string{},
			RepoCredentials: &RepoCredentials{CloneURL: "https://github.com/a/b.git", OAuthToken: "tok"},
			LogQuotaHour:    52428800,
		}},
		{"runner_run_response", RunResponse{WorkingDir: "/root/work", Username: "root"}},
		{"runner_pull", PullResponse{
			JobStates: []JobStateEvent{
				{State: JobRunning, Timestamp: 1760000000000},
				{State: JobDone, Timestamp: 1760000001001, ExitStatus: &exit0},
			},
			JobLogs:     []LogEvent{{Message: []byte("hello\r\n\x1b[1mworld\x1b[0m\n"), Timestamp: 1760000000001}},
			RunnerLogs:  []LogEvent{{Message: []byte("Logging configured log_level=info\n"), Timestamp: 1760000001000}},
			LastUpdated: 1760000001001, NoConnectionsSecs: 12, HasMore: false,
		}},
		{"runner_pull_failed", PullResponse{
			JobStates:   []JobStateEvent{{State: JobFailed, Timestamp: 1760000002000, ExitStatus: &exit3}},
			JobLogs:     []LogEvent{},
			RunnerLogs:  []LogEvent{},
			LastUpdated: 1760000002000, HasMore: true,
		}},
		{"runner_metrics", MetricsResponse{TimestampMicro: 1760000000123456, CPUUsageMicro: 5000000, MemoryUsageBytes: 1 << 30,
			MemoryWorkingSetBytes: 900 << 20, GPUs: []GPUMetrics{{GPUMemoryUsageBytes: 2 << 30, GPUUtilPercent: 87}}}},
		{"runner_metrics_no_gpu", MetricsResponse{TimestampMicro: 1, GPUs: []GPUMetrics{}}},
	}
}

func TestGolden(t *testing.T) {
	for _, tc := range goldenCases() {
		t.Run(tc.name, func(t *testing.T) {
			got, err := json.Marshal(tc.value)
			if err != nil {
				t.Fatalf("marshal: %v", err)
			}
			path := filepath.Join("testdata", tc.name+".json")
			if *update {
				var pretty bytes.Buffer
				if err := json.Indent(&pretty, got, "", "  "); err != nil {
					t.Fatal(err)
				}
				pretty.WriteByte('\n')
				if err := os.WriteFile(path, pretty.Bytes(), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			raw, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("read golden (run go test ./api -update to create): %v", err)
			}
			var want bytes.Buffer
			if err := json.Compact(&want, raw); err != nil {
				t.Fatalf("golden is not JSON: %v", err)
			}
			if !bytes.Equal(got, want.Bytes()) {
				t.Fatalf("encoding drifted from %s\n got: %s\nwant: %s", path, got, want.Bytes())
			}
			// Decode the golden into a fresh value of the same type and
			// re-encode: the shape must survive a round trip.
			fresh := reflect.New(reflect.TypeOf(tc.value))
			if err := json.Unmarshal(raw, fresh.Interface()); err != nil {
				t.Fatalf("decode golden: %v", err)
			}
			again, err := json.Marshal(fresh.Elem().Interface())
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(again, want.Bytes()) {
				t.Fatalf("round trip changed the shape\n got: %s\nwant: %s", again, want.Bytes())
			}
		})
	}
}

// TestWireQuirks pins the details the dstack server depends on, spelled out so
// a golden-file regeneration cannot silently change them.
func TestWireQuirks(t *testing.T) {
	enc := func(v any) string {
		t.Helper()
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	tests := []struct {
		name      string
		got, want string
	}{
		{"gpus_ids spelling", enc(TaskInfoResponse{GPUIDs: []string{"GPU-1"}}),
			`{"id":"","status":"","termination_reason":"","termination_message":"","ports":null,"image_pull_progress":null,"container_name":"","container_id":"","gpus_ids":["GPU-1"]}`},
		{"ports null before start", enc(TaskInfoResponse{}.Ports), `null`},
		{"ports [] in host mode", enc(TaskInfoResponse{Ports: []PortMapping{}}.Ports), `[]`},
		{"submit response uses Go field names", enc(TaskInfoResponse{ID: "x", GPUIDs: []string{}}.SubmitResponse()),
			`{"ID":"x","Status":"","TerminationReason":"","TerminationMessage":"","Ports":null,"ImagePullProgress":null,"ContainerName":"","ContainerID":"","GpuIDs":[]}`},
		{"log message is standard base64", enc(LogEvent{Message: []byte{0xfb, 0xff, 'h', 'i'}, Timestamp: 5}),
			`{"message":"+/9oaQ==","timestamp":5}`},
		{"instance info omits empty keys", enc(InstanceInfoResponse{}), `{}`},
		{"exit_status null when unset", enc(JobStateEvent{State: JobRunning, Timestamp: 1}),
			`{"state":"running","timestamp":1,"termination_reason":"","termination_message":"","exit_status":null}`},
		{"dcgm null", enc(InstanceHealthResponse{}), `{"dcgm":null}`},
		{"terminate timeout is an integer", enc(TaskTerminateRequest{Timeout: 0}),
			`{"termination_reason":"","termination_message":"","timeout":0}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.got != tc.want {
				t.Fatalf("got  %s\nwant %s", tc.got, tc.want)
			}
		})
	}
}

func TestDecodeServerSubmitBodyWithNulls(t *testing.T) {
	// What the dstack server really sends for a minimal task: many nulls and
	// keys we do not model (run_spec duplicate, gateway-era leftovers).
	const body = `{
	  "run": {"id": "r", "run_spec": {"run_name": "n", "repo_id": "rid", "repo_data": null,
	          "configuration": {"type": "task", "nodes": 1}, "configuration_path": null, "new_key": 1}},
	  "job_spec": {"replica_num": 0, "job_num": 0, "jobs_per_replica": 1, "user": null,
	          "commands": ["/bin/sh", "-i", "-c", "echo hi"], "env": {}, "single_branch": null,
	          "max_duration": null, "ssh_key": null, "working_dir": null, "repo_dir": "/workflow",
	          "repo_data": {"repo_type": "virtual"}, "repo_exists_action": null, "file_archives": []},
	  "job_submission": {"id": "s"},
	  "cluster_info": {"job_ips": [""], "master_job_ip": "", "gpus_per_job": 0, "gpus_per_node": []},
	  "secrets": {}, "repo_credentials": null, "log_quota_hour": null,
	  "run_spec": {"run_name": "n"}, "something_newer": {"x": [1, 2]}
	}`
	var b SubmitBody
	if err := json.Unmarshal([]byte(body), &b); err != nil {
		t.Fatalf("decode: %v", err)
	}
	if b.JobSpec.User != nil || b.JobSpec.WorkingDir != nil || b.JobSpec.SSHKey != nil || b.RepoCredentials != nil {
		t.Fatalf("nulls must decode to nil pointers: %+v", b.JobSpec)
	}
	if b.JobSpec.MaxDuration != 0 || b.LogQuotaHour != 0 || b.JobSpec.SingleBranch {
		t.Fatalf("nulls must decode to zero values: %+v", b)
	}
	if b.Run.RunSpec.Configuration.Type != "task" || !bytes.Contains(b.Run.RunSpec.Configuration.Raw, []byte(`"nodes"`)) {
		t.Fatalf("configuration kept raw with its type: %+v", b.Run.RunSpec.Configuration)
	}
	if *b.JobSpec.RepoDir != "/workflow" || b.JobSpec.RepoData.RepoType != RepoVirtual {
		t.Fatalf("repo fields: %+v", b.JobSpec)
	}
}

func TestDecodeTaskConfigNullsAndUnknown(t *testing.T) {
	const body = `{"id":"t","name":"n","image_name":"i","gpu":-1,"cpu":null,"memory":null,
	  "volumes":[{"backend":"gcp","name":"v","volume_id":"pd-1","init_fs":false,"device_name":null}],
	  "instance_mounts":[{"instance_path":"/a","path":"/b","optional":true}],
	  "host_ssh_keys":null,"future_field":{"nested":true}}`
	var c TaskConfig
	if err := json.Unmarshal([]byte(body), &c); err != nil {
		t.Fatalf("decode: %v", err)
	}
	if c.GPU != -1 || c.CPU != 0 || c.Memory != 0 || c.HostSSHKeys != nil {
		t.Fatalf("unexpected: %+v", c)
	}
	if c.Volumes[0].DeviceName != "" || c.Volumes[0].Backend != "gcp" || !c.InstanceMounts[0].Optional {
		t.Fatalf("unexpected nested: %+v", c)
	}
}

func TestTaskListLegacyIDs(t *testing.T) {
	var l TaskListResponse
	if err := json.Unmarshal([]byte(`{"ids":["a","b"]}`), &l); err != nil {
		t.Fatal(err)
	}
	if len(l.IDs) != 2 || l.Tasks != nil {
		t.Fatalf("got %+v", l)
	}
}

func TestHostInfoGPUMemoryForms(t *testing.T) {
	tests := []struct {
		in      string
		want    MiB
		wantErr bool
	}{
		{`16384`, 16384, false},
		{`"16384 MiB"`, 16384, false},
		{`"16384"`, 16384, false},
		{`null`, 0, false},
		{`"lots"`, 0, true},
		{`true`, 0, true},
	}
	for _, tc := range tests {
		var h HostInfo
		err := json.Unmarshal([]byte(`{"gpu_memory":`+tc.in+`}`), &h)
		if (err != nil) != tc.wantErr {
			t.Fatalf("%s: err = %v, wantErr %v", tc.in, err, tc.wantErr)
		}
		if err == nil && h.GPUMemory != tc.want {
			t.Fatalf("%s: got %d want %d", tc.in, h.GPUMemory, tc.want)
		}
	}
}

func FuzzDecodeHostInfo(f *testing.F) {
	f.Add([]byte(`{"gpu_memory":"16384 MiB","gpu_count":1}`))
	f.Add([]byte(`{"gpu_memory":81920}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var h HostInfo
		if err := json.Unmarshal(b, &h); err != nil {
			return
		}
		out, err := json.Marshal(h)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		var again HostInfo
		if err := json.Unmarshal(out, &again); err != nil {
			t.Fatalf("own output does not decode: %v", err)
		}
	})
}

func FuzzDecodeSubmitBody(f *testing.F) {
	f.Add([]byte(`{"job_spec":{"commands":["a"],"user":{"uid":1}},"run":{"run_spec":{"configuration":{"type":"task"}}}}`))
	f.Add([]byte(`{"run":{"run_spec":{"configuration":null}}}`))
	f.Add([]byte(`{"job_spec":{"commands":["a"]},"tandem":{"no_pull":true,"run":true}}`))
	f.Add([]byte(`{"job_spec":{"commands":["a"]},"tandem":{"stdin":"none","tty":{"rows":24,"cols":80}}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var s SubmitBody
		if err := json.Unmarshal(b, &s); err != nil {
			return
		}
		if _, err := json.Marshal(s); err != nil {
			t.Fatalf("decoded body does not re-encode: %v", err)
		}
	})
}
