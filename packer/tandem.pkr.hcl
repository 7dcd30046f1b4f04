# GPU host images (Ubuntu 22.04/24.04, Debian 12) with Docker and Tandem's
# agents baked in:
#   packer build -var os=ubuntu -var os_version=24.04 -var flavor=nvidia -only='amazon-ebs.tandem' .
#   packer build -var os=debian -var os_version=12 -only='qemu.tandem' .
# Build the binaries first (make build); they are uploaded from var.bin_dir.
# The build waits for the base image's cloud-init, and any apt error fails it.

variable "os" {
  type        = string
  default     = "ubuntu"
  description = "ubuntu or debian"
  validation {
    condition     = contains(["ubuntu", "debian"], var.os)
    error_message = "The os variable must be ubuntu or debian."
  }
}

variable "os_version" {
  type        = string
  default     = "22.04"
  description = "ubuntu: 22.04 or 24.04; debian: 12"
}

variable "flavor" {
  type        = string
  default     = "cpu"
  description = "cpu, or nvidia (driver with Fabric Manager, held; container toolkit with CDI; persistenced)"
  validation {
    condition     = contains(["cpu", "nvidia"], var.flavor)
    error_message = "The flavor variable must be cpu or nvidia."
  }
}

variable "nvidia_driver_version" {
  type        = string
  default     = "580"
  description = "the driver branch (Ubuntu's nvidia-driver-N-server packages; a retired branch installs its successor); Fabric Manager is pinned to the exact version installed"
}

variable "nvidia_kernel_modules" {
  type        = string
  default     = "open"
  description = "open (required for Blackwell; NVIDIA's choice from Turing on) or proprietary (Volta and older)"
  validation {
    condition     = contains(["open", "proprietary"], var.nvidia_kernel_modules)
    error_message = "The nvidia_kernel_modules variable must be open or proprietary."
  }
}

variable "prepull_images" {
  type        = list(string)
  default     = []
  description = "images pulled during the build and kept: present on first boot, the first job does not wait for them"
}

variable "prepull_registry_auth" {
  type = map(object({
    username = string
    password = string
  }))
  default     = {}
  sensitive   = true
  description = "logins for prepull_images' registries, by registry host: used for the pulls, logged out after (no credential stays in the image)"
}

variable "prepull_insecure_registries" {
  type        = list(string)
  default     = []
  description = "registries (host:port) prepull_images come from over plain HTTP, for the build only"
}

variable "bin_dir" {
  type    = string
  default = "../bin"
}

variable "aws_region" {
  type    = string
  default = "us-east-1"
}

variable "aws_instance_type" {
  type    = string
  default = "g5.xlarge"
}

variable "gcp_project_id" {
  type    = string
  default = "my-project"
}

variable "gcp_zone" {
  type    = string
  default = "us-central1-a"
}

variable "qemu_image_url" {
  type        = string
  default     = ""
  description = "the base cloud image (default: the OS's official one); its default user must accept var.qemu_ssh_key, e.g. through var.qemu_seed_files"
}

variable "qemu_ssh_key" {
  type    = string
  default = "~/.ssh/id_ed25519"
}

variable "qemu_seed_files" {
  type        = list(string)
  default     = []
  description = "user-data and meta-data for a NoCloud seed (a CD labelled cidata) that lets the build in"
}

variable "qemu_accelerator" {
  type        = string
  default     = "kvm"
  description = "kvm, or tcg (software emulation) where there is no KVM"
}

variable "qemu_args" {
  type        = list(list(string))
  default     = []
  description = "extra QEMU arguments (e.g. -kernel for a base image without a boot loader)"
}

variable "qemu_output_dir" {
  type    = string
  default = "output-qemu"
}

locals {
  release = "${var.os}-${var.os_version}"
  user    = { ubuntu = "ubuntu", debian = "debian" }[var.os]
  ami_filter = {
    "ubuntu-22.04" = "ubuntu/images/hvm-ssd/ubuntu-jammy-22.04-amd64-server-*"
    "ubuntu-24.04" = "ubuntu/images/hvm-ssd-gp3/ubuntu-noble-24.04-amd64-server-*"
    "debian-12"    = "debian-12-amd64-*"
  }[local.release]
  ami_owner  = { ubuntu = "099720109477", debian = "136693071363" }[var.os]
  gcp_family = { "ubuntu-22.04" = "ubuntu-2204-lts", "ubuntu-24.04" = "ubuntu-2404-lts-amd64", "debian-12" = "debian-12" }[local.release]
  qemu_image = var.qemu_image_url != "" ? var.qemu_image_url : {
    "ubuntu-22.04" = "https://cloud-images.ubuntu.com/jammy/current/jammy-server-cloudimg-amd64.img"
    "ubuntu-24.04" = "https://cloud-images.ubuntu.com/noble/current/noble-server-cloudimg-amd64.img"
    "debian-12"    = "https://cloud.debian.org/images/cloud/bookworm/latest/debian-12-generic-amd64.qcow2"
  }[local.release]
  name = "tandem-${var.os}-${replace(var.os_version, ".", "")}-${var.flavor}-${formatdate("YYYYMMDDhhmm", timestamp())}"
}

source "amazon-ebs" "tandem" {
  region        = var.aws_region
  instance_type = var.aws_instance_type
  ami_name      = local.name
  ssh_username  = local.user
  source_ami_filter {
    filters = {
      name                = local.ami_filter
      virtualization-type = "hvm"
      root-device-type    = "ebs"
    }
    owners      = [local.ami_owner]
    most_recent = true
  }
  launch_block_device_mappings {
    device_name           = "/dev/sda1"
    volume_size           = 100
    volume_type           = "gp3"
    throughput            = 125
    iops                  = 3000
    delete_on_termination = true
  }
}

source "googlecompute" "tandem" {
  project_id          = var.gcp_project_id
  zone                = var.gcp_zone
  source_image_family = local.gcp_family
  image_name          = local.name
  ssh_username        = local.user
  disk_size           = 100
  machine_type        = "n1-standard-4"
}

source "qemu" "tandem" {
  iso_url              = local.qemu_image
  iso_checksum         = "none"
  disk_image           = true
  disk_size            = "40G"
  format               = "qcow2"
  accelerator          = var.qemu_accelerator
  qemuargs             = var.qemu_args
  cd_files             = var.qemu_seed_files
  cd_label             = "cidata"
  headless             = true
  ssh_username         = local.user
  ssh_private_key_file = var.qemu_ssh_key
  ssh_timeout          = "15m"
  shutdown_command     = "sudo shutdown -P now"
  output_directory     = var.qemu_output_dir
  vm_name              = "${local.name}.qcow2"
}

build {
  sources = ["source.amazon-ebs.tandem", "source.googlecompute.tandem", "source.qemu.tandem"]

  provisioner "shell" {
    inline = ["mkdir -p /tmp/tandem"]
  }

  provisioner "file" {
    sources = ["${var.bin_dir}/dstack-shim", "${var.bin_dir}/dstack-runner", "files/dstack-shim.service", "files/shim.env",
    "../cloudinit/scripts/docker-data-root.sh", "../cloudinit/scripts/tandem-docker-data-root.service"]
    destination = "/tmp/tandem/"
  }

  provisioner "shell" {
    # The variables reach the scripts through a file sourced as root (not
    # the command line: prepull_registry_auth is a secret).
    use_env_var_file = true
    execute_command  = "sudo bash -c '. {{ .EnvVarFile }} && bash {{ .Path }}'"
    environment_vars = ["OS=${var.os}", "FLAVOR=${var.flavor}", "NVIDIA_DRIVER_VERSION=${var.nvidia_driver_version}",
      "NVIDIA_KERNEL_MODULES=${var.nvidia_kernel_modules}", "PREPULL_IMAGES=${join(" ", var.prepull_images)}", "PREPULL_AUTH=${jsonencode(var.prepull_registry_auth)}",
    "PREPULL_INSECURE_REGISTRIES=${join(" ", var.prepull_insecure_registries)}", "DEBIAN_FRONTEND=noninteractive"]
    scripts = [
      "scripts/00-wait-cloud-init.sh",
      "scripts/10-base.sh",
      "scripts/20-docker.sh",
      "scripts/30-nvidia.sh",
      "scripts/40-tandem.sh",
      "scripts/50-prepull.sh",
      "scripts/90-cleanup.sh",
    ]
  }
}
