# Ubuntu GPU host images with Docker and Tandem's agents baked in.
#   packer build -var flavor=nvidia -var ubuntu_version=24.04 -only='amazon-ebs.ubuntu' .
# Build the binaries first (make build); they are uploaded from var.bin_dir.

variable "ubuntu_version" {
  type        = string
  default     = "22.04"
  description = "22.04 or 24.04"
}

variable "flavor" {
  type        = string
  default     = "cpu"
  description = "cpu, or nvidia (driver, container toolkit with CDI, persistenced)"
}

variable "nvidia_driver_version" {
  type    = string
  default = "550"
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
  default     = "https://cloud-images.ubuntu.com/jammy/current/jammy-server-cloudimg-amd64.img"
  description = "an Ubuntu cloud image whose ubuntu user accepts var.qemu_ssh_key"
}

variable "qemu_ssh_key" {
  type    = string
  default = "~/.ssh/id_ed25519"
}

locals {
  codename   = { "22.04" = "jammy", "24.04" = "noble" }[var.ubuntu_version]
  gcp_family = { "22.04" = "ubuntu-2204-lts", "24.04" = "ubuntu-2404-lts-amd64" }[var.ubuntu_version]
  name       = "tandem-ubuntu-${replace(var.ubuntu_version, ".", "")}-${var.flavor}-${formatdate("YYYYMMDDhhmm", timestamp())}"
}

source "amazon-ebs" "ubuntu" {
  region        = var.aws_region
  instance_type = var.aws_instance_type
  ami_name      = local.name
  ssh_username  = "ubuntu"
  source_ami_filter {
    filters = {
      name                = "ubuntu/images/hvm-ssd*/ubuntu-${local.codename}-${var.ubuntu_version}-amd64-server-*"
      virtualization-type = "hvm"
      root-device-type    = "ebs"
    }
    owners      = ["099720109477"]
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

source "googlecompute" "ubuntu" {
  project_id          = var.gcp_project_id
  zone                = var.gcp_zone
  source_image_family = local.gcp_family
  image_name          = local.name
  ssh_username        = "ubuntu"
  disk_size           = 100
  machine_type        = "n1-standard-4"
}

source "qemu" "ubuntu" {
  iso_url              = var.qemu_image_url
  iso_checksum         = "none"
  disk_image           = true
  disk_size            = "40G"
  format               = "qcow2"
  headless             = true
  ssh_username         = "ubuntu"
  ssh_private_key_file = var.qemu_ssh_key
  shutdown_command     = "sudo shutdown -P now"
  vm_name              = "${local.name}.qcow2"
}

build {
  sources = ["source.amazon-ebs.ubuntu", "source.googlecompute.ubuntu", "source.qemu.ubuntu"]

  provisioner "shell" {
    inline = ["mkdir -p /tmp/tandem"]
  }

  provisioner "file" {
    sources     = ["${var.bin_dir}/dstack-shim", "${var.bin_dir}/dstack-runner", "files/dstack-shim.service", "files/shim.env"]
    destination = "/tmp/tandem/"
  }

  provisioner "shell" {
    execute_command  = "sudo -E bash '{{ .Path }}'"
    environment_vars = ["FLAVOR=${var.flavor}", "NVIDIA_DRIVER_VERSION=${var.nvidia_driver_version}", "DEBIAN_FRONTEND=noninteractive"]
    scripts = [
      "scripts/10-base.sh",
      "scripts/20-docker.sh",
      "scripts/30-nvidia.sh",
      "scripts/40-tandem.sh",
      "scripts/90-cleanup.sh",
    ]
  }
}
