"""services/engine"""
