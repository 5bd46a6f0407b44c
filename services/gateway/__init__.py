"""services/gateway"""
